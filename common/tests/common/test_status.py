"""Domain errors become gRPC statuses with standard google.rpc details."""

import base64

import pytest
from google.rpc import code_pb2, error_details_pb2
from grpc_status import rpc_status

from tandem.client import errors
from tandem.client.status import MAX_INFO_BYTES, MAX_INFO_NAME_BYTES, MAX_MESSAGE_BYTES, to_status_proto


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


def _trailer_bytes(error: errors.TandemError) -> int:
    """The trailers a status takes on the wire: grpc-status-details-bin in base64, grpc-message with each
    byte outside printable ASCII (and '%') percent-encoded as three."""
    status = rpc_status.to_status(to_status_proto(error))
    binary = sum(len(base64.b64encode(v)) for k, v in status.trailing_metadata if isinstance(v, bytes))
    return binary + sum(1 if 0x20 <= b <= 0x7E and b != 0x25 else 3 for b in status.details.encode())


@pytest.mark.parametrize("num_bytes", [4000, 5000, 6000, 7000, 8000, 9000, 10_000, 11_000])
@pytest.mark.parametrize("num_entries", [1, 100])
def test_an_error_info_passed_on_from_another_server_is_bounded_to_fit_the_trailing_metadata(
    num_bytes: int, num_entries: int
) -> None:
    # An encoder's ErrorInfo of 5-11 KB, passed on as it came, took the decoder's status past a client's
    # 8 KiB soft limit: RESOURCE_EXHAUSTED "received metadata size exceeds soft limit" for 2-11 of 20.
    # Here beside a message, field and description of the widest script, each at its own bound.
    metadata = {f"key{i}": "v" * (num_bytes // num_entries) for i in range(num_entries)}
    info = errors.ErrorInfo("IMAGE_FORMAT", "tandem.encoder", metadata)
    error = errors.InvalidArgument("\U0001f600" * 400, "\U0001f600" * 400, info=info)
    assert _trailer_bytes(error) < 6500
    error_info = error_details_pb2.ErrorInfo()
    assert to_status_proto(error).details[1].Unpack(error_info)
    assert (error_info.reason, error_info.domain) == ("IMAGE_FORMAT", "tandem.encoder")
    assert len(error_info.SerializeToString()) <= MAX_INFO_BYTES
    assert all(value == metadata[key] for key, value in error_info.metadata.items())  # whole, or left out


def test_an_error_info_keeps_the_entries_that_fit_and_drops_one_whose_key_or_value_is_too_long() -> None:
    info = errors.ErrorInfo(
        "QUEUE_FULL",
        "tandem.decoder",
        {"k" * (MAX_INFO_NAME_BYTES + 1): "1", "maxWaitingRequests": "256", "note": "\udcff", "v": "9" * 200},
    )
    error_info = error_details_pb2.ErrorInfo()
    assert to_status_proto(errors.ResourceExhausted("queue full", info=info)).details[1].Unpack(error_info)
    assert dict(error_info.metadata) == {"maxWaitingRequests": "256"}


@pytest.mark.parametrize(
    "info",
    [
        errors.ErrorInfo("R" * (MAX_INFO_NAME_BYTES + 1), "tandem.encoder"),
        errors.ErrorInfo("QUEUE_FULL", "d" * (MAX_INFO_NAME_BYTES + 1)),
        errors.ErrorInfo("QUEUE_\udcff", "tandem.decoder"),
    ],
    ids=["reason", "domain", "no-utf8"],
)
def test_an_error_info_whose_reason_or_domain_does_not_fit_is_left_out(info: errors.ErrorInfo) -> None:
    # Cut, it would be another reason, which a caller might branch on.
    assert len(to_status_proto(errors.ResourceExhausted("full", info=info)).details) == 1  # RetryInfo alone
