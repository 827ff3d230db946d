"""oversized: a request longer than its method can use is refused naming the field holding most of it."""

from __future__ import annotations

from tandem.client.oversized import oversized
from tandem.client.pb.tandem.v1 import encoder_pb2, tensor_pb2

DESCRIPTOR = encoder_pb2.EmbedRequest.DESCRIPTOR


def test_the_field_holding_most_of_the_bytes_is_named_with_the_size_and_the_limit() -> None:
    ids = encoder_pb2.EmbedRequest(
        request_id="r" * 100, model="m", token_ids=tensor_pb2.TokenIds(ids=[7] * 5000)
    ).SerializeToString()
    error = oversized(ids, 1000, DESCRIPTOR)
    assert error.field == "token_ids"
    assert f"{len(ids)} bytes" in str(error) and "at most 1000" in str(error)
    text = encoder_pb2.EmbedRequest(text="a" * 5000, output_dtype=tensor_pb2.DATA_TYPE_FLOAT16)
    assert oversized(text.SerializeToString(), 1000, DESCRIPTOR).field == "text"


def test_bytes_that_do_not_walk_as_a_message_blame_the_request() -> None:
    assert (
        oversized(b"\x22\xff\xff\xff\x7f" + b"x" * 10, 5, DESCRIPTOR).field == "request"
    )  # length past the end
    assert oversized(b"\x0f" * 10, 5, DESCRIPTOR).field == "request"  # wire type 7 does not exist
    assert oversized(b"\x98\x07" + b"\x01", 2, DESCRIPTOR).field == "request"  # field 115: unknown here
