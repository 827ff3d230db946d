"""oversized: a request longer than its method can use is refused naming the field holding most of it."""

from __future__ import annotations

from tandem.client.oversized import MAX_FIELDS_WALKED, oversized
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


def test_a_request_of_more_fields_than_the_walk_visits_blames_the_request_and_says_why() -> None:
    # 2 MB of two-byte fields held the event loop 0.8-1.8 s (32 MB: 11-25 s) while each tag was walked in
    # Python, to name request_id; the walk now stops at MAX_FIELDS_WALKED, where no field yet holds most.
    raw = b"\x08\x01" * 1_000_000
    error = oversized(raw, 1000, DESCRIPTOR)
    assert (error.field, error.description) == (
        "request",
        "the request is 2000000 bytes; this method can use at most 1000 (its longest useful input), so it "
        f"was not parsed; it has over {MAX_FIELDS_WALKED} fields, and the first {MAX_FIELDS_WALKED} name no "
        "field holding over half its bytes",
    )


def test_a_field_holding_most_of_the_bytes_is_named_though_the_walk_stops_short() -> None:
    text = encoder_pb2.EmbedRequest(text="a" * 100_000).SerializeToString()
    tiny = b"\x08\x01" * (MAX_FIELDS_WALKED + 1)
    error = oversized(text + tiny, 1000, DESCRIPTOR)
    assert error.field == "text"
    assert error.description.endswith(
        f"; it has over {MAX_FIELDS_WALKED} fields, and of the first {MAX_FIELDS_WALKED} this one holds over "
        "half its bytes"
    )
    assert oversized(tiny + text, 1000, DESCRIPTOR).field == "request"  # not reached: not named


def test_a_request_of_as_many_fields_as_the_walk_visits_is_walked_whole() -> None:
    error = oversized(b"\x08\x01" * MAX_FIELDS_WALKED, 1000, DESCRIPTOR)
    assert error.field == "request_id" and error.description.endswith("so it was not parsed")
