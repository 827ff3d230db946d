"""The decoder's model info, held by the gateway: the first ask is shared by the callers with one token
that come before it and not kept when it fails; later, a held answer is served at once while one refresh
runs beside the requests, outside their traces, a failed one kept and tried again no sooner than
RETRY_S, said once."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
from collections.abc import AsyncIterator

import grpc
import pytest

from tandem.client.pb.tandem.v1 import decoder_pb2
from tandem.gateway import decoder_info
from tandem.gateway.decoder_info import DecoderInfo

TOKEN = (("authorization", "Bearer good"),)
CALLER = contextvars.ContextVar("caller", default="")  # a caller's context (its trace, say)


def _refused(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="no")


class Decoder:
    """A stub's GetModelInfo: answers `model` after `delay_s` (and once `gate` is set, where there is
    one: a replica stopped or busy for as long as a test holds it), or raises `error`; counts the asks
    and the caller context each ran in."""

    def __init__(self) -> None:
        self.model, self.delay_s, self.error = "m1", 0.0, None
        self.gate: asyncio.Event | None = None
        self.num_asks = 0
        self.callers: list[str] = []

    async def GetModelInfo(
        self, request, metadata=None, timeout=None
    ) -> decoder_pb2.DecoderGetModelInfoResponse:
        self.num_asks += 1
        self.callers.append(CALLER.get())
        await asyncio.sleep(self.delay_s)
        if self.gate is not None:
            await self.gate.wait()
        if self.error is not None:
            raise self.error
        return decoder_pb2.DecoderGetModelInfoResponse(model=self.model)


class _Clock:
    """`time` as decoder_info reads it, its monotonic clock moved by the test."""

    now = 1000.0

    def monotonic(self) -> float:
        return self.now


def _info(decoder: Decoder, targets: tuple[str, ...] = ("a",)) -> DecoderInfo:
    @contextlib.asynccontextmanager
    async def stub() -> AsyncIterator[Decoder]:
        yield decoder

    return DecoderInfo(stub, lambda: targets)  # type: ignore[arg-type]


async def test_the_first_ask_is_shared_by_the_requests_before_it_and_a_failed_one_is_not_kept() -> None:
    """Waiting in turn on a lock, each request asked again after the one before it failed: 504s at 10,
    20 and 30 s for 3 requests against a decoder that did not answer."""
    decoder = Decoder()
    decoder.delay_s, decoder.error = 0.05, _refused(grpc.StatusCode.UNAVAILABLE)
    info = _info(decoder)
    answers = await asyncio.gather(*(info.get(TOKEN) for _ in range(3)), return_exceptions=True)
    assert all(isinstance(a, grpc.aio.AioRpcError) for a in answers) and decoder.num_asks == 1
    decoder.error = None
    assert (await info.get(TOKEN)).model == "m1" and decoder.num_asks == 2


async def test_a_held_answer_is_served_at_once_while_its_refresh_waits_outside_the_callers_trace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(decoder_info, "MAX_AGE_S", 0.0)
    decoder = Decoder()
    info = _info(decoder)
    await info.get(TOKEN)
    decoder.model, decoder.gate = "m2", asyncio.Event()
    CALLER.set("request 7")
    # Not waiting on the refresh, held until the gate opens: a wait would run into the timeout.
    assert (await asyncio.wait_for(info.get(TOKEN), 5.0)).model == "m1"
    decoder.gate.set()
    async with asyncio.timeout(5):
        while (await info.get(TOKEN)).model != "m2":
            await asyncio.sleep(0.01)
    assert decoder.callers[1] == ""  # the refresh ran in no caller's context
    await info.close()


async def test_a_failed_refresh_keeps_the_answer_is_tried_again_after_retry_s_and_said_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(decoder_info, "MAX_AGE_S", 0.0)
    clock = _Clock()  # RETRY_S passes when the test says: 20 requests on loaded cores took over 0.2 s
    monkeypatch.setattr(decoder_info, "time", clock)
    decoder = Decoder()
    info = _info(decoder)
    await info.get(TOKEN)
    decoder.error = _refused(grpc.StatusCode.UNAUTHENTICATED)
    with caplog.at_level(logging.WARNING, logger="tandem.gateway"):
        for _ in range(20):
            assert (await info.get(TOKEN)).model == "m1"
            await asyncio.sleep(0.005)  # the refresh started runs, and fails
    assert decoder.num_asks == 2  # the first, and one refresh: the other 19 requests within RETRY_S
    assert len([r for r in caplog.records if "not refreshed" in r.getMessage()]) == 1
    clock.now += decoder_info.RETRY_S
    decoder.error = None
    await info.get(TOKEN)
    async with asyncio.timeout(5):
        while decoder.num_asks < 3:
            await asyncio.sleep(0.01)
    assert (await info.get(TOKEN)).model == "m1" and decoder.num_asks == 3


async def test_close_ends_an_ask_under_way() -> None:
    decoder = Decoder()
    decoder.delay_s = 60.0
    info = _info(decoder)
    waiting = asyncio.ensure_future(info.get(TOKEN))
    await asyncio.sleep(0.01)
    await asyncio.wait_for(info.close(), 5.0)  # at once; not the ask's 60 s
    waiting.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await waiting
