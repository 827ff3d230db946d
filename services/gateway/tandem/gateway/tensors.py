"""Tandem's embeddings extension, in a prompt or a message's content: a part
`{"type": "tandem_embeddings", "embeddings": {"dtype": "bfloat16" | "float16" | "float32",
"shape": [n, hidden], "data": "<base64 of the raw little-endian bytes>"}}` becomes an embeddings part,
checked by the decoder exactly as a gRPC Tensor is (`tandem.common.torch_part.tensors`); nothing is ever
unpickled or `torch.load`ed. `{"type": "tandem_image_embeddings", ...}` is the same rows as an image part
(the encoder's output for an image; the template places it).
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from tandem.client.errors import InvalidArgument
from tandem.client.pb.tandem.v1 import tensor_pb2
from tandem.common.dtypes import BY_NAME, FLOAT_NAMES
from tandem.gateway.fields import shown


def tensor(value: Any, path: str) -> tensor_pb2.Tensor:
    """Tandem's embeddings extension -> a Tensor message (its bytes decoded from base64, nothing else)."""
    if not isinstance(value, dict):
        raise InvalidArgument(path, "must be an object {dtype, shape, data}")
    dtype = value.get("dtype")
    if not isinstance(dtype, str) or dtype not in FLOAT_NAMES:
        raise InvalidArgument(f"{path}.dtype", f"must be one of {', '.join(FLOAT_NAMES)}, got {shown(dtype)}")
    shape = value.get("shape")
    if (
        not isinstance(shape, list)
        or len(shape) != 2
        or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**31 for d in shape)
    ):
        raise InvalidArgument(f"{path}.shape", f"must be [n, hidden_size], got {shown(shape)}")
    data = value.get("data")
    if not isinstance(data, str):
        raise InvalidArgument(f"{path}.data", "must be a base64 string of the raw little-endian bytes")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidArgument(f"{path}.data", "is not valid base64") from None
    return tensor_pb2.Tensor(dtype=BY_NAME[dtype].wire, shape=shape, data=raw)
