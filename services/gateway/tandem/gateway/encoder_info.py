"""The encoder's model info (its width, its input bound, its max_image_bytes): asked once, and asked
again when a picture is over the max_image_bytes it said, and when the encoder replicas it is asked over
change (their targets or their model: `encoders.info_version`).

NOTE: why the replicas' change asks again. Asked once, /v1/embeddings kept answering under the first
model's name, with its width and bounds, after every encoder replica moved to another model. The decoder's
info is refreshed beside the requests (`decoder_info.py`); this one is asked on the first request after
the change, shared and bounded by REASK_TIMEOUT_S as a refusal's ask is: a change is rare (a restart, a
rolling upgrade), and the answer it brings is what that request is answered with. One that fails keeps
the info held and is tried again RETRY_S later.

NOTE: why a refusal asks again. The info was asked once for the gateway's life, so an encoder restarted
with a higher --max-image-bytes still had pictures under its new bound refused 413 by the gateway, until
the gateway restarted too. Asking again on every picture would cost a call each; asking on a refusal
costs one only where the answer may change it. A lowered bound costs no call: the encoder refuses the
picture itself, named the same way (`image_bytes.over_cap`), and the bound it names is held
(`lowered`). Callers asking while a call is out share it, so a flood of pictures over the bound makes
one call at a time, each bounded by REASK_TIMEOUT_S.

NOTE: why a call is shared only by callers with the same metadata (their Authorization). The encoder
answers a call as its token allows: shared with the first caller's token, a bad token's UNAUTHENTICATED
reached a good-token caller asking meanwhile, and a bad token's failed re-ask left a good caller with
the old bound's 413. A token's callers still share one call; a flood of bad tokens costs a call each
(each answered UNAUTHENTICATED by the encoder, as any of their calls would be)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc

from tandem.client.errors import Unavailable
from tandem.client.pb.tandem.v1 import encoder_pb2, encoder_pb2_grpc

# The longest a refusal waits on the encoder's word before it stands on what the encoder said before.
REASK_TIMEOUT_S = 2.0
# The first call's bound: nothing can be answered without it.
ASK_TIMEOUT_S = 10.0
RETRY_S = 1.0  # an ask on the replicas' change that failed is tried again no sooner

Metadata = tuple[tuple[str, str], ...] | None


class EncoderInfo:
    """The encoder's GetModelInfo, held; one call at a time, shared by those who ask meanwhile."""

    def __init__(
        self, stub: encoder_pb2_grpc.EncoderStub, version: Callable[[], object] = lambda: None
    ) -> None:
        self._stub = stub
        self._version = version  # what the replicas answering are: asked again when it changes
        self._info: encoder_pb2.EncoderGetModelInfoResponse | None = None
        self._asked_version: object = None  # `version` when the held info was asked
        self._tried_at = float("-inf")  # the last ask on a change that failed, time.monotonic()
        # The call out for each metadata (the callers' token, `app.py` `_metadata`).
        self._asking: dict[Metadata, asyncio.Future[encoder_pb2.EncoderGetModelInfoResponse]] = {}

    async def get(self, metadata: Metadata) -> encoder_pb2.EncoderGetModelInfoResponse:
        """What the encoder said last, asked the first time and again when its replicas changed."""
        if self._info is None:
            return await self._ask(metadata, ASK_TIMEOUT_S)
        if self._version() != self._asked_version and time.monotonic() - self._tried_at >= RETRY_S:
            if (info := await self.asked_again(metadata)) is not None:
                return info
            self._tried_at = time.monotonic()
        return self._info

    async def asked_again(self, metadata: Metadata) -> encoder_pb2.EncoderGetModelInfoResponse | None:
        """What the encoder says now, or None where it does not answer (down, or restarting) within
        REASK_TIMEOUT_S (or none serves its model): the caller keeps what it said before."""
        try:
            return await self._ask(metadata, REASK_TIMEOUT_S)
        except (grpc.aio.AioRpcError, Unavailable):
            return None

    def lowered(self, max_image_bytes: int) -> None:
        """The encoder refused a picture over `max_image_bytes`, below what it said (it restarted with a
        lower one): held, so the next picture over it is refused before any call."""
        if self._info is not None and not 0 < self._info.max_image_bytes <= max_image_bytes:
            info = encoder_pb2.EncoderGetModelInfoResponse()
            info.CopyFrom(self._info)
            info.max_image_bytes = max_image_bytes
            self._info = info

    async def _ask(self, metadata: Metadata, timeout_s: float) -> encoder_pb2.EncoderGetModelInfoResponse:
        if (asking := self._asking.get(metadata)) is None:
            asking = self._asking[metadata] = asyncio.ensure_future(self._call(metadata, timeout_s))
            asking.add_done_callback(lambda done: self._asked(metadata, done))
        # Shielded: a caller that goes away (its client hung up) does not cancel the others' call.
        return await asyncio.shield(asking)

    async def _call(self, metadata: Metadata, timeout_s: float) -> encoder_pb2.EncoderGetModelInfoResponse:
        version = self._version()
        self._info = await self._stub.GetModelInfo(
            encoder_pb2.EncoderGetModelInfoRequest(), metadata=metadata, timeout=timeout_s
        )
        self._asked_version, self._tried_at = version, float("-inf")
        return self._info

    def _asked(
        self, metadata: Metadata, asking: asyncio.Future[encoder_pb2.EncoderGetModelInfoResponse]
    ) -> None:
        if self._asking.get(metadata) is asking:
            del self._asking[metadata]
        if not asking.cancelled():
            asking.exception()  # seen, where every caller went away before it failed: not logged as lost
