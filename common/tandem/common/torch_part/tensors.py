"""`tandem.v1.Tensor` <-> torch / numpy: the only place bytes meet tensors.

Wire format: little-endian, C-contiguous, no padding, `len(data) == prod(shape) * itemsize`.
Decoding checks every declared size against the real byte count *before* touching the payload,
so a tiny message that claims a huge shape costs nothing, then wraps the bytes without a copy
(`torch.frombuffer`). The returned tensor is read-only in spirit (it aliases the message's bytes):
callers that write to it must `.clone()` first; casting to the model dtype copies anyway.

`tandem.v1.SharedTensor` is the same layout in a shared-memory segment (`shared_memory.py`): the
writer's rows are written into the segment (by its embedder straight into a `shared_view`, or copied
there, cast on the way) and digested where they lie; the reader checks the handle as it checks a
Tensor, then its bounds against the segment, copies the bytes into memory of its own and checks the
digest of that copy. At most one copy on each side, and the rows the reader keeps are the bytes it
checked: a segment written again after its lease cannot change them.
"""

from __future__ import annotations

import hmac
import math
import mmap
import sys
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from tandem.client.errors import InvalidArgument
from tandem.client.pb.tandem.v1 import tensor_pb2
from tandem.common.dtypes import BY_WIRE, FLOAT_DATA_TYPES
from tandem.common.torch_part.shm_digest import keyed_digest
from tandem.common.torch_part.shm_segment_maps import Segment
from tandem.common.torch_part.torch_dtypes import BY_TORCH, TORCH_DTYPES

DataType = tensor_pb2.DataType

_TORCH_DTYPES: dict[int, torch.dtype] = {wire: TORCH_DTYPES[d.name] for wire, d in BY_WIRE.items()}
_LITTLE_ENDIAN = sys.byteorder == "little"


@dataclass(frozen=True)
class TensorLimits:
    """What a decoder of untrusted tensors accepts. Built once from the service config."""

    max_elements: int = 64 * 1024 * 1024  # cap on prod(shape), checked before any allocation.
    # Cap on len(shape) where the caller names no rank of its own, checked before a dimension is read:
    # a shape takes a byte a dimension, so a 4 MB message holds 4 million of them. Rows are [n, hidden].
    max_rank: int = 8
    allowed_dtypes: frozenset[int] = FLOAT_DATA_TYPES  # wire dtypes accepted.


DEFAULT_LIMITS = TensorLimits()


class TooManyElements(InvalidArgument):
    """A shape over TensorLimits.max_elements: the size of what was asked for, so the asker's to
    change, wherever the tensor came from (a service's reply to a caller's long input included)."""


def to_torch_dtype(dtype: int, field: str = "dtype") -> torch.dtype:
    try:
        return _TORCH_DTYPES[dtype]
    except KeyError:
        raise InvalidArgument(field, f"unknown or unset dtype {dtype}") from None


def to_wire_dtype(dtype: torch.dtype) -> int:
    try:
        return BY_TORCH[dtype].wire
    except KeyError:
        raise ValueError(f"{dtype} has no wire encoding") from None


def decode(
    message: tensor_pb2.Tensor,
    field: str = "tensor",
    *,
    rank: int | None = None,
    last_dim: int | None = None,
    check_finite: bool = False,
    limits: TensorLimits = DEFAULT_LIMITS,
) -> torch.Tensor:
    """Validate and wrap a Tensor message; raises InvalidArgument naming `field` and the limit.

    Zero-copy for every dtype on little-endian hosts: the result aliases `message.data`.
    """
    torch_dtype, shape, num_elements = _checked_header(
        message.dtype, message.shape, field, rank, last_dim, limits
    )
    itemsize = torch_dtype.itemsize
    data = message.data  # read once: each read of a bytes field makes a new copy of it
    if len(data) != num_elements * itemsize:
        raise InvalidArgument(
            f"{field}.data",
            f"expected {num_elements * itemsize} bytes for shape {shape} of "
            f"{DataType.Name(message.dtype)}, got {len(data)}",
        )
    with warnings.catch_warnings():
        # frombuffer warns that protobuf's bytes are immutable; the module docstring covers why
        # aliasing them is safe.
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(data, dtype=torch_dtype)
    if not _LITTLE_ENDIAN:
        flat = _byteswapped(flat)
    tensor = flat.view(shape)
    if check_finite:
        require_finite(tensor, field)
    return tensor


def _checked_header(
    dtype: int, shape_field: object, field: str, rank: int | None, last_dim: int | None, limits: TensorLimits
) -> tuple[torch.dtype, list[int], int]:
    """A tensor's dtype and shape checked against `limits` before any byte is looked at: its torch
    dtype, its shape and its element count."""
    if dtype not in limits.allowed_dtypes:
        allowed = ", ".join(DataType.Name(d) for d in sorted(limits.allowed_dtypes))
        name = DataType.Name(dtype) if dtype in DataType.values() else str(dtype)
        raise InvalidArgument(f"{field}.dtype", f"{name} is not accepted here; expected one of {allowed}")
    # The rank from the count alone (len() of a repeated field reads no element): listing, checking and
    # printing 1 million dimensions took 0.16 s and made a 3 MB error text, each call.
    num_dims = len(shape_field)  # type: ignore[arg-type]
    if rank is not None and num_dims != rank:
        raise InvalidArgument(
            f"{field}.shape", f"expected rank {rank}, got rank {num_dims}: {_shown(shape_field, num_dims)}"
        )
    if num_dims > limits.max_rank:
        raise InvalidArgument(
            f"{field}.shape", f"more than {limits.max_rank} dimensions: {_shown(shape_field, num_dims)}"
        )
    shape = list(shape_field)  # type: ignore[call-overload]
    if not shape:
        raise InvalidArgument(f"{field}.shape", "must have at least one dimension")
    for i, dim in enumerate(shape):
        if dim < 1:
            raise InvalidArgument(f"{field}.shape", f"dimension {i} is {dim}; every dimension must be >= 1")
    if last_dim is not None and shape[-1] != last_dim:
        raise InvalidArgument(f"{field}.shape", f"last dimension must be {last_dim}, got {shape[-1]}")
    # Python ints do not overflow, so a hostile shape cannot wrap around to a small count; and the count
    # stops at the first dimension past the limit (each is >= 1, so it only grows): math.prod of a
    # shape of 40,000 dimensions of 2^62, 360 KB on the wire, took 4.9 s on the event loop, growing
    # with the square of its length (minutes for a 4 MB message), then failed to print (INTERNAL).
    num_elements = 1
    for i, dim in enumerate(shape):
        num_elements *= dim
        if num_elements > limits.max_elements:
            counted = f"{num_elements}" if i == len(shape) - 1 else f"more than {limits.max_elements}"
            raise TooManyElements(
                f"{field}.shape", f"{counted} elements exceed the limit of {limits.max_elements}"
            )
    return _TORCH_DTYPES[dtype], shape, num_elements


def _shown(shape_field: object, num_dims: int, most: int = 4) -> str:
    """A shape for an error text: whole up to `most` dimensions, else its first ones and its count."""
    first = list(shape_field[:most])  # type: ignore[index]
    return str(first) if num_dims <= most else f"{str(first)[:-1]}, ... ({num_dims} dimensions)]"


def require_finite(tensor: torch.Tensor, field: str, sent: torch.Tensor | None = None) -> None:
    """Raises InvalidArgument naming `field`.data and the first NaN or Inf; integer tensors pass.

    Checks the tensor in its own dtype: to hold values to a narrower one (a model's bf16 or fp16),
    cast first, since a value finite in float32 can overflow to inf there. `sent`: the tensor as it
    came, before that cast, read only on a refusal to say whether the values were already not finite
    as sent (in its dtype) or became so in the cast.
    """
    if not tensor.dtype.is_floating_point or bool(torch.isfinite(tensor).all()):
        return
    if sent is not None and sent.dtype.is_floating_point and not bool(torch.isfinite(sent).all()):
        raise InvalidArgument(
            f"{field}.data",
            f"contains NaN or Inf as sent, in {_dtype_name(sent)} (first at index "
            f"{_first_non_finite(sent)}); values must be finite",
        )
    dtype = _dtype_name(tensor)
    # Round to nearest: a magnitude below max + half its last step rounds to max, from there to Inf.
    info = torch.finfo(tensor.dtype)
    overflow = info.max + info.max / (2 - info.eps) * info.eps / 2
    digits = _significant_digits(info)
    raise InvalidArgument(
        f"{field}.data",
        f"contains NaN or Inf as {dtype} (first at index {_first_non_finite(tensor)}); values must be "
        f"finite as {dtype}, whose largest is +-{info.max:.{digits}g} (magnitudes from "
        f"{overflow:.{digits}g} round to Inf)",
    )


def _dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _first_non_finite(tensor: torch.Tensor) -> list[int]:
    first = int((~torch.isfinite(tensor.reshape(-1))).nonzero()[0, 0])
    return [int(i) for i in np.unravel_index(first, tuple(tensor.shape))]


def _significant_digits(info: torch.finfo) -> int:
    """Digits that tell apart every value of a dtype (9 for float32), at least 6: float32's largest
    value and where Inf begins both printed 3.40282e+38 at 6."""
    return max(6, math.ceil((1 - math.log2(info.eps)) * math.log10(2)) + 1)


def encode(tensor: torch.Tensor | np.ndarray, dtype: torch.dtype | None = None) -> tensor_pb2.Tensor:
    """Pack a tensor (optionally cast to `dtype` first). One copy: into the message's bytes."""
    if isinstance(tensor, np.ndarray):
        tensor = torch.from_numpy(np.ascontiguousarray(tensor))
    if dtype is not None and tensor.dtype != dtype:
        tensor = tensor.to(dtype)
    wire = to_wire_dtype(tensor.dtype)
    tensor = tensor.detach().to("cpu").contiguous()
    if not _LITTLE_ENDIAN:
        tensor = _byteswapped(tensor)
    # numpy has no bfloat16: reinterpret 2-byte types as int16 to reach the raw bytes.
    raw = tensor.view(torch.int16) if tensor.dtype.itemsize == 2 else tensor
    return tensor_pb2.Tensor(dtype=wire, shape=list(tensor.shape), data=raw.numpy().tobytes())


def shared_num_bytes(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> int:
    """Bytes `encode_shared` writes for `tensor` cast to `dtype`."""
    return tensor.numel() * (dtype or tensor.dtype).itemsize


def shared_view(segment: mmap.mmap, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    """[*shape] of `dtype` over the segment's first bytes, writable: rows an embedder writes into it
    are in the segment with no copy of their own (`seal_shared` then digests them). While it lives the
    mapping cannot be closed (BufferError), so a view kept by mistake is an error, never a tensor over
    unmapped memory (torch.frombuffer keeps no export; numpy's does)."""
    assert _LITTLE_ENDIAN, "shared segments are only offered on little-endian hosts"
    num_bytes = math.prod(shape) * dtype.itemsize
    return torch.from_numpy(np.frombuffer(segment, dtype=np.uint8, count=num_bytes)).view(dtype).view(shape)


def copy_into(target: torch.Tensor, rows: torch.Tensor) -> None:
    """Writes `rows` into `target` (a segment's view, same shape), cast on the way: one pass."""
    if rows.dtype != target.dtype:
        target.copy_(rows)  # the cast writes into the segment itself: numpy has no bfloat16
        return
    source = rows.detach().to("cpu").contiguous()  # no copy when already so
    # numpy's copy, on this thread: torch's copy_ splits it over its intra-op threads, which on a busy
    # machine waited for each other (0.3 GB/s measured beside other work, numpy 3-9 GB/s).
    np.copyto(_bytes_of(target), _bytes_of(source))


def seal_shared(
    segment: mmap.mmap, shape: list[int], dtype: torch.dtype, name: str, key: bytes, lease_s: float
) -> tensor_pb2.SharedTensor:
    """The handle of the rows at the segment's start, [*shape] of `dtype`, digested under `key` as they
    lie there: what the writer wrote, since no one else writes its leased segment (shared_memory.py)."""
    num_bytes = math.prod(shape) * dtype.itemsize
    with memoryview(segment) as whole:
        digest = keyed_digest(whole[:num_bytes], key)
    return tensor_pb2.SharedTensor(
        name=name, offset=0, dtype=to_wire_dtype(dtype), shape=shape, digest=digest, lease_s=lease_s
    )


def encode_shared(
    tensor: torch.Tensor,
    segment: mmap.mmap,  # writable, at least shared_num_bytes(tensor, dtype) bytes
    name: str,
    key: bytes,
    lease_s: float,
    dtype: torch.dtype | None = None,
) -> tensor_pb2.SharedTensor:
    """Write `tensor` (cast to `dtype` first if it is another) at the segment's start, and its handle."""
    shape, dtype = list(tensor.shape), dtype or tensor.dtype
    copy_into(shared_view(segment, shape, dtype), tensor)
    return seal_shared(segment, shape, dtype, name, key, lease_s)


def decode_shared(
    message: tensor_pb2.SharedTensor,
    segment: Segment,  # the segment the reader opened: the name it asked for
    key: bytes,  # the digest key the reader sent
    field: str = "tensor",
    *,
    rank: int | None = None,
    last_dim: int | None = None,
    limits: TensorLimits = DEFAULT_LIMITS,
) -> torch.Tensor:
    """Validate a SharedTensor handle against its segment and copy the rows out; raises
    InvalidArgument naming `field`: its dtype and shape as for a Tensor, then its bounds in the
    segment, then its digest against the bytes copied. The result is the reader's own memory."""
    torch_dtype, shape, num_elements = _checked_header(
        message.dtype, message.shape, field, rank, last_dim, limits
    )
    itemsize = torch_dtype.itemsize
    num_bytes = num_elements * itemsize
    offset = message.offset
    if offset % itemsize:
        raise InvalidArgument(f"{field}.offset", f"{offset} is not a multiple of the element size {itemsize}")
    if offset + num_bytes > segment.num_bytes:
        raise InvalidArgument(
            f"{field}.shape",
            f"{num_bytes} bytes for shape {shape} of {DataType.Name(message.dtype)} at offset {offset} run "
            f"past the segment's {segment.num_bytes} bytes",
        )
    # numpy's allocation: a large torch.empty is fresh pages each time here (faulting cost 20 times the
    # copy measured), numpy's comes back from the heap.
    copy = np.empty(num_bytes, dtype=np.uint8)  # [num_bytes]
    digest = segment.read_digested(offset, copy, key)
    if digest is None:
        raise InvalidArgument(f"{field}.shape", f"the segment shrank below {offset + num_bytes} bytes")
    if not hmac.compare_digest(digest, message.digest):
        raise InvalidArgument(
            f"{field}.digest",
            "does not match the segment's bytes: the segment was changed, or the handle is not this call's",
        )
    return torch.from_numpy(copy).view(torch_dtype).view(shape)


def _bytes_of(tensor: torch.Tensor) -> np.ndarray:
    """A contiguous tensor's bytes as numpy sees them (numpy has no bfloat16)."""
    return tensor.reshape(-1).view(torch.uint8).numpy()  # [num_bytes]


def _byteswapped(tensor: torch.Tensor) -> torch.Tensor:
    as_bytes = tensor.contiguous().view(torch.uint8).view(-1, tensor.dtype.itemsize)
    return as_bytes.flip(-1).contiguous().view(tensor.dtype).view(tensor.shape)
