"""An encoder's refusal of a part's input becomes the decoder's refusal of the part: the encoder's
BadRequest field under the part's only where it is a field of the EncoderInput the part sent, its
ErrorInfo only when it is full and only where it is one of the encoder's own reasons, with that reason's
keys. (That `encoder_parts` passes a real encoder's status through here, over gRPC, is specified in
test_encoder_errors.py.)"""

from __future__ import annotations

import grpc
import pytest

from tandem.client import error_reasons as reasons
from tandem.client.errors import ErrorInfo, FailedPrecondition, InvalidArgument
from tandem.client.status_details import StatusDetails
from tandem.common.torch_part.prompt_parts import ENCODER_INPUTS
from tandem.decoder.api.encoder_refusal import MAX_FIELD_CHARS, passed_on, refused

PART = "prompt[1].encoder"
CALL_LIMIT = ErrorInfo(reasons.CALL_LIMIT, reasons.ENCODER, {reasons.MAX_CALLS: "4"})


def _refused_on(inner: str, sent: str | None) -> InvalidArgument:
    said = StatusDetails(field_violations=((inner, "bad"),))
    error = refused(grpc.StatusCode.INVALID_ARGUMENT, PART, sent, f"{inner}: bad", said)
    assert isinstance(error, InvalidArgument)
    return error


@pytest.mark.parametrize(
    ("sent", "inner"),
    [("text", "text"), ("image", "image"), ("image", "image.data"), ("token_ids", "token_ids"),
     ("token_ids", "token_ids.ids[3]")],
)  # fmt: skip
def test_a_field_of_the_input_the_part_sent_is_named_under_the_parts(sent: str, inner: str) -> None:
    error = _refused_on(inner, sent)
    assert (error.field, error.description) == (f"{PART}.{inner}", "the encoder refused it: bad")


@pytest.mark.parametrize(
    ("sent", "inner"),
    [
        # Another case of EncoderInput's oneof: the gateway answered param prompt[1].encoder.text for an
        # image part.
        ("image", "text"),
        ("image", "token_ids.ids[999999999]"),
        ("text", "image.data"),
        ("token_ids", "text"),
        (None, "image.data"),  # a call that sent no input (GetModelInfo)
    ],
)
def test_a_field_of_an_input_the_part_did_not_send_leaves_the_parts_own_field(
    sent: str | None, inner: str
) -> None:
    error = _refused_on(inner, sent)
    assert (error.field, error.description) == (PART, f"the encoder refused it: {inner}: bad")


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
        # An index in digits not ASCII, which `\d` matched: they went on to the client and the gateway.
        "token_ids.ids[\u0663]",
        "token_ids.ids[\uff13\uff13]",
        "token_ids.ids[\U0001d7d7\U0001d7d7\U0001d7d7]",
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
    for sent in ENCODER_INPUTS:
        error = _refused_on(inner, sent)
        assert (error.field, error.description) == (PART, f"the encoder refused it: {inner}: bad")


def test_a_failed_precondition_stays_one() -> None:
    said = StatusDetails(field_violations=(("image", "takes no images"),))
    error = refused(grpc.StatusCode.FAILED_PRECONDITION, PART, "image", "image: takes no images", said)
    assert isinstance(error, FailedPrecondition) and error.field == f"{PART}.image"


@pytest.mark.parametrize(
    ("said", "kept"),
    [
        (CALL_LIMIT, CALL_LIMIT),
        (  # a key its reason does not give is left out
            ErrorInfo(reasons.CALL_LIMIT, reasons.ENCODER, {reasons.MAX_CALLS: "4", "k": "v" * 10_000}),
            CALL_LIMIT,
        ),
        (  # not a number: the client was given maxCalls 'x' * 128
            ErrorInfo(reasons.CALL_LIMIT, reasons.ENCODER, {reasons.MAX_CALLS: "x" * 128}),
            ErrorInfo(reasons.CALL_LIMIT, reasons.ENCODER, {}),
        ),
        (
            ErrorInfo(reasons.CALL_LIMIT, reasons.ENCODER, {reasons.MAX_CALLS: "\u0664"}),
            ErrorInfo(reasons.CALL_LIMIT, reasons.ENCODER, {}),
        ),
        (
            ErrorInfo(reasons.CALL_LIMIT, reasons.ENCODER, {reasons.MAX_CALLS: str(2**64 - 1)}),
            ErrorInfo(reasons.CALL_LIMIT, reasons.ENCODER, {reasons.MAX_CALLS: str(2**64 - 1)}),
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


@pytest.mark.parametrize("code", [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION])
def test_a_refusal_of_the_input_goes_on_with_no_error_info(code: grpc.StatusCode) -> None:
    # The encoder's reasons are RESOURCE_EXHAUSTED ones: a 400 carrying CALL_LIMIT read as a call limit,
    # which a retry mends, to a caller that branches on the reason.
    said = StatusDetails(field_violations=(("image.data", "bad"),), info=CALL_LIMIT)
    error = refused(code, PART, "image", "image.data: bad", said)
    assert (error.field, error.info) == (f"{PART}.image.data", None)
