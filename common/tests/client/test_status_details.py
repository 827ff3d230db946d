"""A failed call's google.rpc details, read back from the `grpc-status-details-bin` trailer by a sync
stub and an aio one alike: the RetryInfo and ErrorInfo of a refusal, the BadRequest of a bad field, and
nothing (not an error) where a server sent no details."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
from google.rpc import code_pb2

from tandem.client import error_reasons as reasons
from tandem.client.errors import ErrorInfo, InvalidArgument, ResourceExhausted
from tandem.client.status import ErrorInterceptor, to_status_proto
from tandem.client.status_details import StatusDetails, status_details

BUDGET = reasons.decoder_info(
    reasons.PROMPT_LOGPROB_BUDGET,
    {reasons.HELD_ENTRIES: 60, reasons.NEEDED_ENTRIES: 48, reasons.MAX_ENTRIES: 100},
)


async def _refused(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    raise ResourceExhausted("output.prompt_logprobs: over the budget", retry_after_s=2.5, info=BUDGET)


async def _bad_field(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    raise InvalidArgument("prompt[1].text", "must not be empty")


async def _surrogate(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    # A lone surrogate, as JSON's "\udcff" in a file the refusal quotes gives: it has no UTF-8.
    raise InvalidArgument("adapter_config.json:\udcff", "is not a setting")


async def _unsendable(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    raise ResourceExhausted("full", info=ErrorInfo("FULL", "test", {"name": "\udcff"}))


async def _bare(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    # What a server without the interceptor (an older one, another language's) sends: code and message.
    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "full")
    return b""


@pytest.fixture
async def address() -> AsyncIterator[str]:
    server = grpc.aio.server(interceptors=[ErrorInterceptor()])
    handlers = {
        name: grpc.unary_unary_rpc_method_handler(fn)
        for name, fn in {
            "Refused": _refused,
            "BadField": _bad_field,
            "Surrogate": _surrogate,
            "Unsendable": _unsendable,
            "Bare": _bare,
        }.items()
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Details", handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(0)


async def _aio_error(address: str, method: str) -> grpc.aio.AioRpcError:
    async with grpc.aio.insecure_channel(address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await channel.unary_unary(f"/test.Details/{method}")(b"", timeout=5)
    return caught.value


def _sync_error(address: str, method: str) -> grpc.RpcError:
    with grpc.insecure_channel(address) as channel:
        with pytest.raises(grpc.RpcError) as caught:
            channel.unary_unary(f"/test.Details/{method}")(b"", timeout=5)
    return caught.value


async def test_a_refusal_gives_sync_and_aio_stubs_its_retry_delay_and_error_info(address: str) -> None:
    for error in [
        await _aio_error(address, "Refused"),
        await asyncio.to_thread(_sync_error, address, "Refused"),
    ]:
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
        details = status_details(error)
        assert details == StatusDetails(retry_delay_s=2.5, info=BUDGET)
        assert details.info == ErrorInfo(
            "PROMPT_LOGPROB_BUDGET",
            "tandem.decoder",
            {"heldEntries": "60", "neededEntries": "48", "maxEntries": "100"},
        )
        assert details.metadata_of("tandem.decoder", "PROMPT_LOGPROB_BUDGET") == BUDGET.metadata
        assert details.metadata_of("tandem.decoder", "QUEUE_FULL") is None
        assert details.metadata_of("tandem.encoder", "PROMPT_LOGPROB_BUDGET") is None


async def test_a_bad_field_gives_its_field_violation_and_no_retry(address: str) -> None:
    for error in [
        await _aio_error(address, "BadField"),
        await asyncio.to_thread(_sync_error, address, "BadField"),
    ]:
        assert status_details(error) == StatusDetails(
            field_violations=(("prompt[1].text", "must not be empty"),)
        )


async def test_a_lone_surrogate_in_a_refusal_is_sent_escaped_keeping_its_code(address: str) -> None:
    # Its encode raised inside the interceptor: the caller got UNKNOWN and the exception's text.
    error = await _aio_error(address, "Surrogate")
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == "adapter_config.json:\\udcff: is not a setting"
    assert status_details(error).field_violations == (("adapter_config.json:\\udcff", "is not a setting"),)


async def test_an_error_info_entry_that_cannot_be_sent_is_left_out_and_the_refusal_keeps_its_code(
    address: str,
) -> None:
    # A value with no UTF-8 (a lone surrogate) fits no protobuf string: the refusal was INTERNAL; since
    # ErrorInfo is bounded (status.py) the entry is left out, as one over its size is.
    error = await _aio_error(address, "Unsendable")
    assert (error.code(), error.details()) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "full")
    assert status_details(error).metadata_of("test", "FULL") == {}


async def test_a_status_without_details_reads_as_none(address: str) -> None:
    for error in [await _aio_error(address, "Bare"), await asyncio.to_thread(_sync_error, address, "Bare")]:
        assert status_details(error) == StatusDetails()


def test_details_that_do_not_parse_read_as_none() -> None:
    trailers = grpc.aio.Metadata(("grpc-status-details-bin", b"\xff not a status"))
    error = grpc.aio.AioRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.aio.Metadata(), trailers, "full")
    assert status_details(error) == StatusDetails()


def test_a_refusal_no_wait_can_lift_carries_its_error_info_and_no_retry_delay() -> None:
    # Every LoRA slot loaded: only an UnloadAdapter frees one, so a RetryInfo would invite retries
    # that fail for ever.
    slots = reasons.decoder_info(reasons.LORA_SLOTS, {reasons.MAX_LORAS: 4})
    status = to_status_proto(ResourceExhausted("all 4 LoRA slots are taken", retry_after_s=None, info=slots))
    kinds = [detail.TypeName() for detail in status.details]
    assert status.code == code_pb2.RESOURCE_EXHAUSTED and kinds == ["google.rpc.ErrorInfo"]


def test_a_detail_whose_bytes_do_not_parse_is_skipped_and_the_others_still_read() -> None:
    # A valid Status naming a google.rpc type over junk bytes (a hostile or broken peer): unpacking it
    # raised DecodeError, a gateway 500 and a CLI traceback instead of the refusal.
    status = to_status_proto(ResourceExhausted("full", retry_after_s=2.5, info=BUDGET))
    for name, junk in [
        ("BadRequest", b"\xff\xff\xff"),
        ("RetryInfo", b"\x0a\x05\x08"),
        ("ErrorInfo", b"\x12\xff"),
    ]:
        status.details.add(type_url=f"type.googleapis.com/google.rpc.{name}", value=junk)
    trailers = grpc.aio.Metadata(("grpc-status-details-bin", status.SerializeToString()))
    error = grpc.aio.AioRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.aio.Metadata(), trailers, "full")
    assert status_details(error) == StatusDetails(retry_delay_s=2.5, info=BUDGET)
