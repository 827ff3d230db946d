"""status: how the interceptor's tolerant parser answers a request that does not parse."""

from __future__ import annotations

import pytest

from tandem.client import errors
from tandem.client.pb.tandem.v1 import encoder_pb2
from tandem.client.status import _reject_malformed, _tolerant

EMBED = "/tandem.v1.Encoder/Embed"
NOT_UTF8_TEXT = encoder_pb2.EmbedRequest(text="@@").SerializeToString().replace(b"@@", b"\xff\xfe")


def test_a_parsers_own_refusal_that_mentions_utf8_keeps_its_status_and_field() -> None:
    # Only protobuf's "String field had bad UTF-8" is to be explained by the walk; since the request type
    # comes from the method's name, Embed's own parser (parse_embed) passed that text test too, so a
    # refusal of its own quoting UTF-8 became INVALID_ARGUMENT naming `request`.
    own = errors.FailedPrecondition("text", "must be UTF-8 of at most 8 tokens for this model")

    def parse_embed(raw: bytes) -> object:
        raise own

    parse = _tolerant(parse_embed, EMBED)
    assert parse is not None
    with pytest.raises(errors.FailedPrecondition) as refused:
        _reject_malformed(parse(NOT_UTF8_TEXT), EMBED)
    assert refused.value is own
