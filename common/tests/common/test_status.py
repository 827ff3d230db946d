"""Domain errors become gRPC statuses with standard google.rpc details."""

import pytest
from google.rpc import code_pb2, error_details_pb2

from tandem.client import errors
from tandem.client.status import MAX_MESSAGE_BYTES, to_status_proto


def test_invalid_argument_carries_a_field_violation() -> None:
    status = to_status_proto(
        errors.InvalidArgument("prompt[2].embeddings.shape", "last dimension must be 64")
    )
    assert status.code == code_pb2.INVALID_ARGUMENT
    bad_request = error_details_pb2.BadRequest()
    assert status.details[0].Unpack(bad_request)
    assert bad_request.field_violations[0].field == "prompt[2].embeddings.shape"
    assert bad_request.field_violations[0].description == "last dimension must be 64"


def test_resource_exhausted_carries_retry_info() -> None:
    status = to_status_proto(errors.ResourceExhausted("queue full", retry_after_s=2.5))
    assert status.code == code_pb2.RESOURCE_EXHAUSTED
    retry = error_details_pb2.RetryInfo()
    assert status.details[0].Unpack(retry)
    assert retry.retry_delay.ToNanoseconds() == 2_500_000_000


def test_an_error_with_an_error_info_carries_it_beside_its_retry_or_field() -> None:
    info = errors.ErrorInfo("QUEUE_FULL", "tandem.decoder", {"maxWaitingRequests": "256"})
    for error, first in [
        (errors.ResourceExhausted("queue full", info=info), error_details_pb2.RetryInfo),
        (errors.InvalidArgument("prompt", "too long", info=info), error_details_pb2.BadRequest),
    ]:
        status = to_status_proto(error)
        assert status.details[0].Is(first.DESCRIPTOR)
        error_info = error_details_pb2.ErrorInfo()
        assert status.details[1].Unpack(error_info)
        assert (error_info.reason, error_info.domain, dict(error_info.metadata)) == (
            "QUEUE_FULL",
            "tandem.decoder",
            {"maxWaitingRequests": "256"},
        )
    assert len(to_status_proto(errors.ResourceExhausted("full")).details) == 1  # none without one


def test_each_domain_error_has_its_code() -> None:
    assert to_status_proto(errors.Unavailable("draining")).code == code_pb2.UNAVAILABLE
    assert to_status_proto(errors.DeadlineExceeded("late")).code == code_pb2.DEADLINE_EXCEEDED
    assert to_status_proto(errors.NotFound("model x")).code == code_pb2.NOT_FOUND
    assert to_status_proto(errors.FailedPrecondition("f", "off")).code == code_pb2.FAILED_PRECONDITION
    fault = to_status_proto(errors.ModelFault("the model produced non-finite logits at output position 3"))
    assert fault.code == code_pb2.INTERNAL and fault.message.endswith("output position 3")


def test_a_message_quoting_a_long_input_is_cut_to_fit_the_trailing_metadata() -> None:
    long = "x" * 20_000
    status = to_status_proto(errors.InvalidArgument("stopping.stop_sequences[0]", f"bad {long}"))
    bad_request = error_details_pb2.BadRequest()
    assert status.details[0].Unpack(bad_request)
    description = bad_request.field_violations[0].description
    assert description.startswith("bad xxx") and description.endswith("more characters)")
    assert len(status.SerializeToString()) < 4 * MAX_MESSAGE_BYTES
    assert len(to_status_proto(errors.NotFound(long)).message) < MAX_MESSAGE_BYTES + 40


@pytest.mark.parametrize("character", ["\u8a9e", "\U0001f600", "%"], ids=["cjk", "emoji", "percent"])
def test_a_message_is_bounded_in_utf8_bytes_never_cutting_a_character(character: str) -> None:
    status = to_status_proto(errors.InvalidArgument("path", f"{character * 5000} is not a directory"))
    bad_request = error_details_pb2.BadRequest()
    assert status.details[0].Unpack(bad_request)
    for text in (status.message, bad_request.field_violations[0].description):
        kept, _, rest = text.partition("... (")
        assert set(kept) <= {character, *"path: "} and len(kept.encode()) <= MAX_MESSAGE_BYTES
        assert rest.endswith("more characters)")
