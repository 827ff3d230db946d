"""The decoder's model info (its name, its context) as the gateway serves it: asked once before anything
is answered, then kept fresh beside the requests.

NOTE: why it is asked again. Asked once for the gateway's life, the first answer's name was kept after a
rolling upgrade to another model, or one decoder restarted with another: every request was a 404
model_not_found, or the new model answered under the old name, until the gateway restarted. So it is
asked again whenever the replicas that serve change, and at least every MAX_AGE_S.

NOTE: why a refresh never runs on a request's path. A refresh may reach a replica stopped or busy but
still connected for the seconds before its watch drops it: asked on the requests' path under one lock,
it held every completion behind it (5 requests 3.9-4.4 s where half would have been served in 0.1 s;
one a 504 at the ask's 10 s timeout). A held answer is served while one refresh runs as its own task,
outside any caller's trace; one that fails keeps the answer it would have replaced and is tried again
RETRY_S later, said once per run of failures.

NOTE: why the first ask is shared. Nothing can be answered before the first answer, so the requests
that come before it wait for the one ask out: waiting in turn on a lock, each asked again after the one
before it failed (3 requests against a decoder that did not answer: 504s at 10, 20 and 30 s). A failed
first ask is not kept: the next request asks again.

NOTE: which replica answers. Over several decoder replicas an ask goes to one of those serving the
gateway's model (`replicas.py`: its name and token table sample), round robin, so each refresh may ask
another. They serve one checkpoint, but each answers with what it was started with (its context from
--num-kv-blocks or --max-model-len, its adapters, --encoder): replicas are taken to be started alike,
and the answer held is one replica's. A replica whose model could not be asked (refused, unanswered) is
among them too where it never said one, or is not checked (`replicas.py`: refused for the configuration,
or unanswered for UNCHECKED_AFTER_S). Where none serves the gateway's model, an ask
raises Unavailable (the gateway's 503) and a refresh keeps the answer held.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager

import grpc

from tandem.client.errors import Unavailable
from tandem.client.pb.tandem.v1 import decoder_pb2, decoder_pb2_grpc

log = logging.getLogger("tandem.gateway")

MAX_AGE_S = 5.0  # asked again this often at most (and whenever the replicas serving change)
RETRY_S = 1.0  # a refresh that failed is tried again no sooner
ASK_TIMEOUT_S = 10.0

Metadata = tuple[tuple[str, str], ...] | None
# The gateway's own decoder stub, held for a call (app.py `_decoder_stub`).
StubOf = Callable[[], AbstractAsyncContextManager[decoder_pb2_grpc.DecoderStub]]


class DecoderInfo:
    """The decoder's GetModelInfo, held and refreshed; `targets` says which replicas serve now."""

    def __init__(self, stub: StubOf, targets: Callable[[], tuple[str, ...]]) -> None:
        self._stub = stub
        self._targets = targets
        self._info: decoder_pb2.DecoderGetModelInfoResponse | None = None
        self._asked_over: tuple[str, ...] = ()  # the replicas the held answer was asked over
        self._asked_at = 0.0  # when, time.monotonic()
        self._tried_at = float("-inf")  # the last refresh that failed, time.monotonic()
        # The first ask out for each metadata (the callers' token, app.py `_metadata`): shared only by
        # callers with the same token, as the decoder answers each as its token allows.
        self._first: dict[Metadata, asyncio.Task[decoder_pb2.DecoderGetModelInfoResponse]] = {}
        self._refresh: asyncio.Task[None] | None = None  # the one refresh under way, if any

    async def get(self, metadata: Metadata) -> decoder_pb2.DecoderGetModelInfoResponse:
        """The held answer (a refresh started beside it where one is due), or the first ask's."""
        info = self._info
        if info is None:
            first = self._first.get(metadata)
            if first is None:
                first = self._first[metadata] = asyncio.create_task(self._ask(metadata))
                first.add_done_callback(lambda task: self._asked_first(metadata, task))
            return await asyncio.shield(first)
        now = time.monotonic()
        is_due = self._targets() != self._asked_over or now - self._asked_at >= MAX_AGE_S
        if is_due and now - self._tried_at >= RETRY_S and (self._refresh is None or self._refresh.done()):
            # Its own context: the refresh belongs to no caller's trace.
            self._refresh = asyncio.create_task(self._refreshed(metadata), context=contextvars.Context())
        return info

    async def close(self) -> None:
        """Ends the asks under way (at shutdown, before the channels close)."""
        for task in (*self._first.values(), self._refresh):
            if task is not None and not task.done():
                task.cancel()
                await asyncio.wait([task])

    def _asked_first(self, metadata: Metadata, task: asyncio.Task) -> None:
        """A first ask ended: not kept (a failed one is asked again by the next request), its failure
        taken here too, where every request that waited on it was cancelled."""
        del self._first[metadata]
        if not task.cancelled():
            task.exception()

    async def _ask(self, metadata: Metadata) -> decoder_pb2.DecoderGetModelInfoResponse:
        targets = self._targets()
        async with self._stub() as stub:
            info = await stub.GetModelInfo(
                decoder_pb2.DecoderGetModelInfoRequest(), metadata=metadata, timeout=ASK_TIMEOUT_S
            )
        self._info, self._asked_over, self._asked_at = info, targets, time.monotonic()
        return info

    async def _refreshed(self, metadata: Metadata) -> None:
        try:
            await self._ask(metadata)
        except (grpc.aio.AioRpcError, Unavailable) as error:  # Unavailable: no replica serves its model
            if self._tried_at == float("-inf"):
                why = error.code().name if isinstance(error, grpc.aio.AioRpcError) else str(error)
                log.warning("the decoder's model info was not refreshed (the last kept): %s", why)
            self._tried_at = time.monotonic()
        else:
            if self._tried_at != float("-inf"):
                log.info("the decoder's model info is refreshed again")
            self._tried_at = float("-inf")
