"""An encoder's refusal of a part's input becomes the decoder's refusal of the part: the encoder's
BadRequest field under the part's only where it is a field of EncoderInput, its ErrorInfo only where it
is one of the encoder's own reasons, with that reason's keys. (That `encoder_parts` passes a real
encoder's status through here, over gRPC, is specified in test_encoder_parts.py.)"""

from __future__ import annotations

import grpc
import pytest

from tandem.client import error_reasons as reasons
from tandem.client.errors import ErrorInfo, FailedPrecondition, InvalidArgument
from tandem.client.status_details import StatusDetails
from tandem.decoder.api.encoder_refusal import MAX_FIELD_CHARS, passed_on, refused

PART = "prompt[1].encoder"
CALL_LIMIT = ErrorInfo(reasons.CALL_LIMIT, reasons.ENCODER, {reasons.MAX_CALLS: "4"})


def _refused_on(inner: str) -> InvalidArgument:
    said = StatusDetails(field_violations=((inner, "bad"),))
    error = refused(grpc.StatusCode.INVALID_ARGUMENT, PART, f"{inner}: bad", said)
    assert isinstance(error, InvalidArgument)
    return error


@pytest.mark.parametrize("inner", ["text", "image", "image.data", "token_ids", "token_ids.ids[3]"])
def test_a_field_of_the_input_is_named_under_the_parts(inner: str) -> None:
    error = _refused_on(inner)
    assert (error.field, error.description) == (f"{PART}.{inner}", "the encoder refused it: bad")


@pytest.mark.parametrize(
    "inner",
    [
        "image.data/../../../etc/passwd",
        "image[0]\x00\x1b[31m",
        "text\nX-Evil: 1\r\n",
        "text]prompt[0].token_ids",
        # Shaped like the decoder's own fields, which the gateway renames (`text.temperature`).
        "text.sampling.temperature",
        "token_ids.ids[3].stopping.max_new_tokens",
        "text" + ".a" * 5000,
        "token_ids.ids[1]" + "[1]" * MAX_FIELD_CHARS,
        "token_ids.ids[1234567890]",
        "token_ids[0]",  # not repeated
        "token_ids.ids.x",  # a name after a repeated field's elements, unindexed
        "image.data.width",  # within bytes
        "output_dtype",  # the decoder's, not the caller's
        "input",  # a oneof, no field
        "prompt[0].text",
        "",
    ],
)
def test_a_path_that_is_no_field_of_the_input_leaves_the_parts_own_field(inner: str) -> None:
    error = _refused_on(inner)
    assert (error.field, error.description) == (PART, f"the encoder refused it: {inner}: bad")


def test_a_failed_precondition_stays_one() -> None:
    said = StatusDetails(field_violations=(("image", "takes no images"),))
    error = refused(grpc.StatusCode.FAILED_PRECONDITION, PART, "image: takes no images", said)
    assert isinstance(error, FailedPrecondition) and error.field == f"{PART}.image"


@pytest.mark.parametrize(
    ("said", "kept"),
    [
        (CALL_LIMIT, CALL_LIMIT),
        (  # a key its reason does not give is left out
            ErrorInfo(reasons.CALL_LIMIT, reasons.ENCODER, {reasons.MAX_CALLS: "4", "k": "v" * 10_000}),
            CALL_LIMIT,
        ),
        # The decoder's domain: the gateway answered 400 on prompt_logprobs for an encoder that was full.
        (ErrorInfo(reasons.PROMPT_LOGPROB_BUDGET, reasons.DECODER, {reasons.MAX_ENTRIES: "1"}), None),
        (ErrorInfo(reasons.QUEUE_FULL, reasons.DECODER, {reasons.MAX_WAITING_REQUESTS: "1"}), None),
        (ErrorInfo(reasons.QUEUE_FULL, reasons.ENCODER, {}), None),  # no reason the encoder gives
        (ErrorInfo(reasons.CALL_LIMIT, "tandem.gateway", {reasons.MAX_CALLS: "4"}), None),
        (None, None),
    ],
)
def test_only_the_encoders_own_error_info_is_passed_on(
    said: ErrorInfo | None, kept: ErrorInfo | None
) -> None:
    assert passed_on(said) == kept
    error = refused(grpc.StatusCode.INVALID_ARGUMENT, PART, "bad", StatusDetails(info=said))
    assert error.info == kept
