"""The tensor codec: round trips are exact and every malformed message names its field."""

import math
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.client.errors import InvalidArgument
from tandem.client.pb.tandem.v1 import tensor_pb2
from tandem.common.torch_part import tensors

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_is_bit_exact(dtype: torch.dtype) -> None:
    original = torch.randn(5, 7).to(dtype)
    decoded = tensors.decode(tensors.encode(original), rank=2, last_dim=7)
    assert decoded.dtype == dtype
    assert torch.equal(decoded.view(torch.uint8), original.view(torch.uint8))


def test_bfloat16_round_trip_preserves_every_bit_pattern() -> None:
    every_pattern = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    decoded = tensors.decode(tensors.encode(every_pattern.reshape(256, 256)))
    assert torch.equal(decoded.view(torch.int16).reshape(-1), every_pattern.view(torch.int16))


def test_wire_format_is_little_endian_c_contiguous() -> None:
    message = tensors.encode(torch.tensor([[1.0, 2.0], [3.0, 4.0]]).t())  # a non-contiguous view
    assert list(message.shape) == [2, 2]
    assert np.frombuffer(message.data, dtype="<f4").tolist() == [1.0, 3.0, 2.0, 4.0]


def test_decode_is_zero_copy() -> None:
    message = tensors.encode(torch.ones(4, 8))
    decoded = tensors.decode(message)
    assert decoded.untyped_storage().nbytes() == len(message.data)
    assert decoded.untyped_storage().data_ptr() == decoded.data_ptr()


def test_encode_accepts_numpy_and_casts() -> None:
    message = tensors.encode(np.arange(6, dtype=np.float64).reshape(2, 3), dtype=torch.float32)
    assert message.dtype == tensor_pb2.DATA_TYPE_FLOAT32
    assert tensors.decode(message).tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]


def _message(dtype=tensor_pb2.DATA_TYPE_FLOAT32, shape=(2, 4), data: bytes | None = None):
    if data is None:
        data = bytes(4 * math.prod(shape))
    return tensor_pb2.Tensor(dtype=dtype, shape=list(shape), data=data)


def _error(message, **kwargs) -> InvalidArgument:
    with pytest.raises(InvalidArgument) as caught:
        tensors.decode(message, "prompt[1].embeddings", **kwargs)
    return caught.value


def test_unknown_dtype_names_the_dtype_field() -> None:
    assert _error(_message(dtype=99)).field == "prompt[1].embeddings.dtype"
    assert _error(_message(dtype=tensor_pb2.DATA_TYPE_UNSPECIFIED)).field == "prompt[1].embeddings.dtype"


def test_int32_is_refused_where_floats_are_expected() -> None:
    assert "DATA_TYPE_INT32" in _error(_message(dtype=tensor_pb2.DATA_TYPE_INT32)).description


def test_wrong_rank_names_the_shape_field() -> None:
    error = _error(_message(shape=(8,)), rank=2)
    assert error.field == "prompt[1].embeddings.shape"
    assert "rank 2" in error.description


def test_a_rank_is_checked_from_the_count_of_dimensions_and_the_refusal_shows_a_few() -> None:
    # A byte a dimension on the wire: 1 million of them (1 MB) were listed, checked and printed whole
    # before the rank refusal, 0.2-0.6 s and a multi-MB error text for every caller that decodes them.
    message = _message(shape=[1] * 1_000_000 + [64], data=b"")
    started = time.perf_counter()
    error = _error(message, rank=2)
    assert time.perf_counter() - started < 0.05
    assert (error.field, error.description) == (
        "prompt[1].embeddings.shape",
        "expected rank 2, got rank 1000001: [1, 1, 1, 1, ... (1000001 dimensions)]",
    )
    assert _error(_message(shape=(8,)), rank=2).description == "expected rank 2, got rank 1: [8]"
    # Without a rank of its own a caller still gets the limits' bound, counted the same way.
    limits = tensors.TensorLimits(max_rank=3)
    error = _error(message, limits=limits)
    assert error.description == "more than 3 dimensions: [1, 1, 1, 1, ... (1000001 dimensions)]"
    assert tensors.decode(_message(shape=(1, 2, 4)), limits=limits).shape == (1, 2, 4)


@pytest.mark.parametrize("shape", [(0, 4), (2, -1), ()])
def test_zero_negative_or_missing_dimensions_are_refused(shape) -> None:
    assert _error(_message(shape=shape, data=b"")).field == "prompt[1].embeddings.shape"


def test_hidden_size_mismatch_states_the_expected_size() -> None:
    error = _error(_message(shape=(2, 4)), last_dim=8)
    assert error.field == "prompt[1].embeddings.shape"
    assert "must be 8" in error.description


def test_byte_length_mismatch_names_the_data_field() -> None:
    error = _error(_message(shape=(2, 4), data=bytes(31)))
    assert error.field == "prompt[1].embeddings.data"
    assert "32 bytes" in error.description


def test_huge_declared_shape_is_refused_before_allocating() -> None:
    # 2**62 elements would be exabytes: refusing it must not try to allocate anything.
    limits = tensors.TensorLimits(max_elements=1 << 20)
    error = _error(_message(shape=(2**31, 2**31), data=b"\0" * 8), limits=limits)
    assert error.field == "prompt[1].embeddings.shape"
    assert "limit" in error.description


def test_a_shape_of_many_huge_dimensions_is_refused_at_once_naming_the_limit() -> None:
    # 40,000 dimensions of 2^62 (360 KB): their whole product took 4.9 s, growing with the square of
    # the count, and then could not be printed (a ValueError: INTERNAL).
    started = time.perf_counter()
    error = _error(_message(shape=[2**62] * 40_000, data=b""), limits=tensors.TensorLimits(max_rank=40_000))
    assert error.field == "prompt[1].embeddings.shape"
    assert error.description == f"more than {1 << 26} elements exceed the limit of {1 << 26}"
    assert time.perf_counter() - started < 1.0
    assert _error(_message(shape=(2**13, 2**13, 2), data=b"")).description == (
        f"{1 << 27} elements exceed the limit of {1 << 26}"  # the whole count, where it is known
    )
    # Its own kind of InvalidArgument: the size asked for, the asker's to change wherever the tensor
    # came from (the decoder keeps it on the caller's field when an encoder's rows are over it).
    assert isinstance(error, tensors.TooManyElements)


def test_huge_shape_under_the_cap_but_short_data_is_a_length_error() -> None:
    error = _error(_message(shape=(1024, 1024), data=b"\0" * 8))
    assert error.field == "prompt[1].embeddings.data"


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_values_are_refused_when_asked(bad: float) -> None:
    values = torch.zeros(3, 4)
    values[2, 1] = bad
    message = tensors.encode(values)
    assert tensors.decode(message).shape == (3, 4)  # not checked unless asked
    error = _error(message, check_finite=True)
    assert error.field == "prompt[1].embeddings.data"
    assert "[2, 1]" in error.description


@pytest.mark.parametrize(
    ("dtype", "largest", "overflow"),
    [
        (torch.bfloat16, "3.38953e+38", "3.39618e+38"),
        (torch.float16, "65504", "65520"),
        (torch.float32, "3.40282347e+38", "3.40282357e+38"),  # at 6 digits both were 3.40282e+38
    ],
)
def test_the_refusal_says_where_values_round_to_inf_and_that_is_where_they_do(
    dtype: torch.dtype, largest: str, overflow: str
) -> None:
    below, at = float(largest), float(overflow)
    wide = torch.tensor([below, at], dtype=torch.float64)
    assert torch.isfinite(wide[0].to(dtype)) and torch.isinf(wide[1].to(dtype))
    with pytest.raises(InvalidArgument) as error:
        tensors.require_finite(wide.to(dtype), "rows", sent=wide)
    assert error.value.field == "rows.data"
    assert f"largest is +-{largest} (magnitudes from {overflow} round to Inf)" in error.value.description


def test_a_value_not_finite_as_sent_is_named_in_the_dtype_it_was_sent_in() -> None:
    # Cast to the model's float32 first, an fp16 Inf from the wire was reported "as float32", with
    # float32's largest value as if the cast had overflowed.
    sent = torch.tensor([[1.0, 2.0], [3.0, float("inf")]], dtype=torch.float16)
    with pytest.raises(InvalidArgument) as error:
        tensors.require_finite(sent.to(torch.float32), "rows", sent=sent)
    assert (error.value.field, error.value.description) == (
        "rows.data",
        "contains NaN or Inf as sent, in float16 (first at index [1, 1]); values must be finite",
    )


@settings(max_examples=200, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    shape=st.lists(st.integers(1, 6), min_size=1, max_size=3),
    seed=st.integers(0, 2**31 - 1),
)
def test_random_tensors_round_trip(dtype: torch.dtype, shape: list[int], seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    original = (torch.randn(shape, generator=generator) * 100).to(dtype)
    decoded = tensors.decode(tensors.encode(original))
    assert torch.equal(decoded.view(torch.uint8), original.view(torch.uint8))


@settings(max_examples=300, deadline=None)
@given(
    dtype=st.integers(-5, 10),
    shape=st.lists(st.integers(-(2**40), 2**40), max_size=5),
    data=st.binary(max_size=256),
)
def test_random_garbage_either_decodes_consistently_or_raises_invalid_argument(dtype, shape, data) -> None:
    message = tensor_pb2.Tensor(dtype=dtype, shape=shape, data=data)
    try:
        decoded = tensors.decode(message, "x", check_finite=True)
    except InvalidArgument as error:
        assert error.field.startswith("x.")
        return
    assert list(decoded.shape) == shape
    assert decoded.numel() * decoded.element_size() == len(data)


# -- SharedTensor: a tensor in a shared-memory segment --------------------------------------------


@pytest.fixture
def reader(tmp_path):
    """The reader's mappings of the segments it is given."""
    from tandem.common.torch_part import shm_segment_maps

    made = shm_segment_maps.SegmentMaps(tmp_path)
    yield made
    made.close()


def _shared(tmp_path, reader, rows: torch.Tensor, dtype: torch.dtype | None = None, spare: int = 0):
    """`rows` written into a new pool segment (with `spare` bytes after them), opened by a call's name:
    the handle, the reader's open segment, the key and the writer's mapping."""
    import os

    from tandem.common.torch_part import shared_memory as shm
    from tandem.common.torch_part import shm_pool

    name, key = shm.new_name(shm.SEGMENT_PREFIX), os.urandom(32)
    segment = shm_pool.PooledSegment.create(tmp_path, tensors.shared_num_bytes(rows, dtype) + spare)
    segment.link(name)
    handle = tensors.encode_shared(rows, segment.mapping, name, key, 5.0, dtype)
    return handle, reader.open(name), key, segment.mapping


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_shared_tensor_round_trips_cast_on_the_way(tmp_path, reader, dtype: torch.dtype) -> None:
    rows = torch.randn(6, 10)
    handle, segment, key, _ = _shared(tmp_path, reader, rows, dtype)
    assert handle.dtype == tensors.to_wire_dtype(dtype) and list(handle.shape) == [6, 10]
    decoded = tensors.decode_shared(handle, segment, key, "rows", rank=2, last_dim=10)
    assert torch.equal(decoded, rows.to(dtype))


def test_a_shared_tensor_is_the_readers_own_copy_which_the_segment_written_again_leaves_alone(
    tmp_path,
    reader,
) -> None:
    rows = torch.randn(2, 4)
    handle, segment, key, written = _shared(tmp_path, reader, rows)
    decoded = tensors.decode_shared(handle, segment, key)
    written[:] = bytes(len(written))  # the pool's next call
    assert torch.equal(decoded, rows)
    decoded += 1  # and it may be written: nobody else holds it
    assert torch.equal(decoded, rows + 1)


def test_a_segment_written_again_before_it_is_read_fails_the_digest(tmp_path, reader) -> None:
    """A reader late past its lease, whose segment the pool gave to the next call: never other rows."""
    handle, segment, key, written = _shared(tmp_path, reader, torch.randn(3, 4))
    np.frombuffer(written, dtype=np.float32)[:] = torch.randn(12).numpy()
    with pytest.raises(InvalidArgument, match=r"rows\.digest: does not match"):
        tensors.decode_shared(handle, segment, key, "rows")


def test_a_changed_byte_or_another_key_fails_the_digest(tmp_path, reader) -> None:
    import os

    handle, segment, key, _ = _shared(tmp_path, reader, torch.randn(3, 4))
    with pytest.raises(InvalidArgument, match=r"rows\.digest: does not match"):
        tensors.decode_shared(handle, segment, os.urandom(len(key)), "rows")
    path = tmp_path / handle.name
    altered = bytearray(path.read_bytes())
    altered[9] ^= 1
    path.write_bytes(bytes(altered))
    with pytest.raises(InvalidArgument, match=r"rows\.digest"):
        tensors.decode_shared(handle, segment, key, "rows")


def test_a_handle_past_its_segment_is_refused_before_reading(tmp_path, reader) -> None:
    handle, segment, key, _ = _shared(tmp_path, reader, torch.randn(3, 4), spare=4)
    longer = tensor_pb2.SharedTensor()
    longer.CopyFrom(handle)
    longer.shape[:] = [4, 4]  # 16 bytes more than the 48 + 4 the segment holds
    with pytest.raises(InvalidArgument, match=r"rows\.shape: 64 bytes .* past the segment's 52 bytes"):
        tensors.decode_shared(longer, segment, key, "rows")
    shifted = tensor_pb2.SharedTensor()
    shifted.CopyFrom(handle)
    shifted.offset = 8  # 8 + 48 > 52
    with pytest.raises(InvalidArgument, match=r"rows\.shape"):
        tensors.decode_shared(shifted, segment, key, "rows")
    shifted.offset = 2
    with pytest.raises(InvalidArgument, match=r"rows\.offset: 2 is not a multiple of the element size 4"):
        tensors.decode_shared(shifted, segment, key, "rows")
    shifted.offset = 2**63  # no wrap-around to a small end
    with pytest.raises(InvalidArgument, match=r"rows\.shape: .* at offset 9223372036854775808 run past"):
        tensors.decode_shared(shifted, segment, key, "rows")


def test_a_shared_handle_is_checked_like_a_tensor(tmp_path, reader) -> None:
    handle, segment, key, _ = _shared(tmp_path, reader, torch.randn(3, 4))
    for change, match in (
        (lambda h: setattr(h, "dtype", tensor_pb2.DATA_TYPE_INT32), r"rows\.dtype"),
        (lambda h: h.shape.__setitem__(slice(None), [12]), r"rows\.shape: expected rank 2"),
        (lambda h: h.shape.__setitem__(slice(None), [4, 3]), r"rows\.shape: last dimension must be 4"),
        (lambda h: h.shape.__setitem__(slice(None), [0, 4]), r"rows\.shape: dimension 0 is 0"),
        (lambda h: h.shape.__setitem__(slice(None), [2**40, 4]), r"rows\.shape: .* exceed the limit"),
    ):
        forged = tensor_pb2.SharedTensor()
        forged.CopyFrom(handle)
        change(forged)
        with pytest.raises(InvalidArgument, match=match):
            tensors.decode_shared(forged, segment, key, "rows", rank=2, last_dim=4)
