"""The encoder's model info (its width, its input bound, its max_image_bytes): asked once before anything
is answered, then asked again beside the requests when the encoder replicas change (the replicas called,
or their model: `encoders.answering`), and on a refusal of a picture over the max_image_bytes it said.

NOTE: why a change is asked beside the requests. Asked once, /v1/embeddings kept answering under the
first model's name, with its width and bounds, after every encoder replica moved to another model. Asked
on the requests' path, a slow GetModelInfo (an encoder busy embedding, 3 s) held 90 of 159 embeddings
up to 2 s each, again and again, the ask's own 2 s bound never letting it answer. So the held info is
answered while one ask runs as its own task (bounded by ASK_TIMEOUT_S, outside any caller's trace), as
the decoder's is (`decoder_info.py`); one that fails keeps the info held and is tried again RETRY_S
later. Only where the replicas' model itself changed do the requests wait on it, for REASK_TIMEOUT_S
from the change at most: the held info is the old model's name and bounds.

NOTE: why a refusal asks again. The info was asked once for the gateway's life, so an encoder restarted
with a higher --max-image-bytes still had pictures under its new bound refused 413 by the gateway, until
the gateway restarted too. Asking again on every picture would cost a call each; asking on a refusal
costs one only where the answer may change it. A lowered bound costs no call: the encoder refuses the
picture itself, named the same way (`image_bytes.over_cap`), and the bound it names is held
(`lowered`). Callers asking while an ask is out share it, each waiting REASK_TIMEOUT_S at most.

NOTE: why it is asked with one token. Asked with each caller's (passed on), a caller's bad token's
UNAUTHENTICATED reached others asking meanwhile, and 50 callers made 50 asks of one change. It is asked
with the token the replicas' models are checked with (`callers.model_check_metadata`: the gateway's own
on its channel, else the least of the services' token file), so every caller shares one ask."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from tandem.client.errors import Unavailable
from tandem.client.pb.tandem.v1 import encoder_pb2, encoder_pb2_grpc

log = logging.getLogger("tandem.gateway")

# The longest a request waits on an ask for the encoder's word (a refusal's, a change of model's) before
# it stands on what the encoder said before.
REASK_TIMEOUT_S = 2.0
ASK_TIMEOUT_S = 10.0  # an ask's own bound; the first one's is every request's: nothing is answered before
RETRY_S = 1.0  # an ask on the replicas' change that failed is tried again no sooner

Metadata = tuple[tuple[str, str], ...] | None
Info = encoder_pb2.EncoderGetModelInfoResponse


@dataclass(frozen=True)
class Answering:
    """Which encoder replicas answer: the held info is asked again on a change of either."""

    model: str | None = None  # the model they serve: a change holds requests on the ask (its name, bounds)
    targets: tuple[str, ...] = ()  # the replicas called: a change is asked beside the requests


AUTH_REFUSALS = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


class EncoderInfo:
    """The encoder's GetModelInfo, held; one ask at a time, shared by every caller."""

    def __init__(
        self,
        stub: encoder_pb2_grpc.EncoderStub,
        answering: Callable[[], Answering] = Answering,
        metadata: Metadata = None,
    ) -> None:
        self._stub = stub
        self._answering = answering  # asked again when it changes
        self._metadata = metadata  # every ask's (`callers.model_check_metadata`)
        self._info: Info | None = None
        self._asked: Answering | None = None  # `answering` when the held info was asked
        self._tried_at = float("-inf")  # the last ask that failed, time.monotonic()
        self._waited_for: str | None = None  # the last model change the requests waited on
        self._waiting_until = float("-inf")  # ... until then, time.monotonic()
        self._asking: asyncio.Task[Info] | None = None  # the one ask out, if any

    async def get(self, caller: Metadata = None) -> Info:
        """What the encoder said last: the first ask's answer, then the held one, asked again beside the
        requests when its replicas change (waited on for REASK_TIMEOUT_S where their model changed).
        `caller`: the asking caller's token, tried where the encoders refuse the check's (a rotation)."""
        if self._info is None:
            return await asyncio.shield(self._ask(caller))  # a caller that goes away does not cancel it
        answering = self._answering()
        if answering == self._asked:
            return self._info
        is_new_model = self._asked is not None and answering.model != self._asked.model
        if is_new_model and answering.model != self._waited_for:
            self._waited_for, self._waiting_until = answering.model, time.monotonic() + REASK_TIMEOUT_S
        if time.monotonic() - self._tried_at >= RETRY_S or self._asking is not None:
            asking = self._ask(caller)
            if answering.model == self._waited_for and (left_s := self._waiting_until - time.monotonic()) > 0:
                await asyncio.wait([asking], timeout=left_s)
        return self._info

    async def asked_again(self) -> Info | None:
        """What the encoder says now, or None where it does not answer (down, or restarting) within
        REASK_TIMEOUT_S (or none serves its model): the caller keeps what it said before."""
        asking = self._ask()
        await asyncio.wait([asking], timeout=REASK_TIMEOUT_S)
        if not asking.done() or asking.cancelled() or asking.exception() is not None:
            return None
        return asking.result()

    def lowered(self, max_image_bytes: int) -> None:
        """The encoder refused a picture over `max_image_bytes`, below what it said (it restarted with a
        lower one): held, so the next picture over it is refused before any call."""
        if self._info is not None and not 0 < self._info.max_image_bytes <= max_image_bytes:
            info = Info()
            info.CopyFrom(self._info)
            info.max_image_bytes = max_image_bytes
            self._info = info

    async def close(self) -> None:
        """Ends the ask under way (at shutdown, before the channels close)."""
        if self._asking is not None and not self._asking.done():
            self._asking.cancel()
            await asyncio.wait([self._asking])

    def _ask(self, caller: Metadata = None) -> asyncio.Task[Info]:
        """The ask out, or a new one: its own task, in a context of its own (no caller's trace)."""
        if self._asking is None:
            self._asking = asyncio.create_task(self._call(caller), context=contextvars.Context())
            self._asking.add_done_callback(self._asked_done)
        return self._asking

    async def _call(self, caller: Metadata = None) -> Info:
        answering = self._answering()
        try:
            try:
                info = await self._stub.GetModelInfo(
                    encoder_pb2.EncoderGetModelInfoRequest(), metadata=self._metadata, timeout=ASK_TIMEOUT_S
                )
            except grpc.aio.AioRpcError as error:
                # The check's token (the least of --auth-token-file) refused mid-rotation, where the
                # caller's is taken: a good caller got 401 on every embedding. Asked with the caller's.
                if caller is None or caller == self._metadata or error.code() not in AUTH_REFUSALS:
                    raise
                info = await self._stub.GetModelInfo(
                    encoder_pb2.EncoderGetModelInfoRequest(), metadata=caller, timeout=ASK_TIMEOUT_S
                )
        except (grpc.aio.AioRpcError, Unavailable) as error:  # Unavailable: no replica serves its model
            if self._info is not None and self._tried_at == float("-inf"):
                why = error.code().name if isinstance(error, grpc.aio.AioRpcError) else str(error)
                log.warning("the encoder's model info was not asked again (the last kept): %s", why)
            self._tried_at = time.monotonic()
            raise
        if self._tried_at != float("-inf") and self._info is not None:
            log.info("the encoder's model info is asked again")
        self._info, self._asked, self._tried_at = info, answering, float("-inf")
        return info

    def _asked_done(self, asking: asyncio.Task[Info]) -> None:
        """The ask ended: the next one is a new one; its failure taken here too, where nobody waited."""
        self._asking = None
        if not asking.cancelled():
            asking.exception()
