"""The `tandem` commands' bounds on the files their flags name are the services' own, written again on
the client's side (common/ imports no service): a service's bound changed alone would leave the command
refusing what the service takes, or reading what it refuses."""

from __future__ import annotations

from tandem.client.channel import DEFAULT_MAX_MESSAGE_BYTES
from tandem.common import flags, structured_flags
from tandem.decoder.engine.sampling import structured
from tandem.encoder.config import SMALL_FIELDS_BYTES


def test_a_schema_or_grammar_file_is_bounded_at_the_decoders_limit() -> None:
    assert structured_flags.MAX_SOURCE_CHARS == structured.MAX_SOURCE_CHARS


def test_an_image_file_is_bounded_at_what_one_call_to_the_encoder_carries() -> None:
    assert flags.MAX_IMAGE_FILE_BYTES == DEFAULT_MAX_MESSAGE_BYTES - SMALL_FIELDS_BYTES
