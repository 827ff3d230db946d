"""The one table of Tandem's dtypes: each one's name, its wire enum and its size. Torch-free.

Every other list of dtypes is derived from this table: the wire codec's torch dtypes
(`torch_part/torch_dtypes.py`, the one place a name becomes a `torch.dtype`), the `--dtype` choices of the
services, the CLI and the GGUF import, the gateway's JSON dtypes and the encoder's output dtypes.
The gateway and the torch-free parts of the contract read it without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.client.pb.tandem.v1 import tensor_pb2


@dataclass(frozen=True)
class DType:
    """One dtype, as every part of Tandem names it."""

    name: str  # flags, configs and JSON bodies ("bfloat16"); also torch's attribute name for it
    wire: int  # tensor_pb2.DATA_TYPE_*: the Tensor message's dtype
    itemsize: int  # bytes per element on the wire and in memory
    is_float: bool  # a float dtype: what embedding rows and a model's compute may be


# In the wire enum's order: the order the gateway's and the encoder's messages list them in.
DTYPES: tuple[DType, ...] = (
    DType("float32", tensor_pb2.DATA_TYPE_FLOAT32, 4, True),
    DType("float16", tensor_pb2.DATA_TYPE_FLOAT16, 2, True),
    DType("bfloat16", tensor_pb2.DATA_TYPE_BFLOAT16, 2, True),
    DType("int32", tensor_pb2.DATA_TYPE_INT32, 4, False),
)
BY_NAME: dict[str, DType] = {d.name: d for d in DTYPES}
BY_WIRE: dict[int, DType] = {d.wire: d for d in DTYPES}

# The float dtypes: what an embeddings tensor may be on the wire, in a JSON body or from `tandem embed`.
FLOAT_NAMES: tuple[str, ...] = tuple(d.name for d in DTYPES if d.is_float)
FLOAT_DATA_TYPES: frozenset[int] = frozenset(BY_NAME[name].wire for name in FLOAT_NAMES)
# What a service computes in (`--dtype`, and the GGUF import's written weights): every float dtype, since
# a model's rows go on the wire in its own dtype. Listed alphabetically, as the flags always have.
COMPUTE_NAMES: tuple[str, ...] = tuple(sorted(FLOAT_NAMES))
