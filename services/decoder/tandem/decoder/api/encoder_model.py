"""Which model the encoder serves, for `encoder_parts.py`: asked at start (`check_model`) or at the first
encoder part (`name`), kept once an encoder of this decoder's model answers, and checked again on every
Embed reply (`check_reply`). The samples are compared in `encoder_model_check.py`.

Its own module, apart from the fetching: asked once for all parts and its answer kept, where a part's
fetch reads only the name (part of its cache key) and the embedder kind (whether its rows count as the
input's positions), and names this module's errors on the caller's field.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import grpc

from tandem.client.client import EncoderClient
from tandem.client.pb.tandem.v1 import encoder_pb2
from tandem.common import replica_name
from tandem.common.torch_part import shared_memory
from tandem.decoder.api.encoder_faults import encoder_named, ran_out
from tandem.decoder.api.encoder_model_check import EncoderModelCheck, Mismatch
from tandem.decoder.api.shared_fetches import SharedFetches

CHECK_RETRY_S = 0.25  # between GetModelInfo calls to an encoder still loading its model


class EncoderMismatch(Exception):
    """The encoder serves another model than this decoder's: the message (the operator's words) names
    both, the encoder and this decoder's checkpoint; `told`, a caller's words, the two models alone."""

    def __init__(self, mismatch: Mismatch) -> None:
        super().__init__(mismatch.said)
        self.told = mismatch.told


class EncoderModel:
    def __init__(self, address: str, client: EncoderClient, check: EncoderModelCheck, shm_dir: Path) -> None:
        self.address = address
        self.client = client
        self.check = check
        self.shm_dir = shm_dir  # where a reply of another model may have written its segment
        # The encoder's model name, part of every cache key: asked until an encoder of this decoder's
        # model answers, then kept (each reply's own model is checked all the same: `check_reply`).
        self.model: str | None = None
        # Its embedder kind (GetModelInfo.embedder), said with the name: whether a part's rows are one
        # per position of its input as this decoder's tokenizer reads it (EncoderPrompt.counts_as_input).
        self.embedder: str | None = None
        # The GetModelInfo calls running until then, by the caller's bearer token: parts asking meanwhile
        # share one, each waiting at most its own time. Under a lock held for the whole call, the k-th
        # of k parts waited k calls' time (a hung encoder: 60 s each), far past its own deadline.
        self._infos: SharedFetches[tuple[encoder_pb2.EncoderGetModelInfoResponse, str | None]] = (
            SharedFetches()
        )

    async def check_model(self, wait_s: float) -> str:
        """Asks the encoder which model it serves, for at most `wait_s` (it may still be loading), and
        compares it with this decoder's. Returns a line for the log saying what was found; raises
        EncoderMismatch naming both models."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while (remaining_s := deadline - loop.time()) > 0:
            try:
                call = self.client.stub.GetModelInfo(
                    encoder_pb2.EncoderGetModelInfoRequest(), timeout=remaining_s, wait_for_ready=True
                )
                info = await call
                replica = replica_name.reported(await call.initial_metadata())
            except grpc.aio.AioRpcError as error:
                if error.code() == grpc.StatusCode.UNAVAILABLE:  # loading, or not listening yet
                    await asyncio.sleep(min(CHECK_RETRY_S, max(0.0, deadline - loop.time())))
                    continue
                if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    break
                # e.g. UNAUTHENTICATED: the encoder wants a token, which only a caller's call carries
                named = encoder_named(self.address, error)
                return (
                    f"encoder {named} did not say which model it serves ({error.code().name}: "
                    f"{error.details()}): checked at its first encoder part"
                )
            mismatch = self.check.info_mismatch(info, replica)
            if mismatch is not None:
                raise EncoderMismatch(mismatch)
            self.model, self.embedder = info.model, info.embedder
            who = replica_name.answering(self.address, replica)
            if not info.HasField("token_table_sample") or self.check.table_sample is None:
                return (
                    f"encoder {who} serves {info.model!r} and reports no token table sample (a "
                    "version before it did): which model it serves is not checked"
                )
            return f"encoder {who} serves {info.model!r}, this decoder's model"
        return (
            f"encoder {self.address} did not answer within {wait_s:g} s: which model it serves is "
            "checked at its first encoder part"
        )

    async def name(
        self, token: tuple[str | bytes, ...], timeout_s: float, metadata: tuple[tuple[str, str | bytes], ...]
    ) -> str:
        """The encoder's model name (every cache key holds it), asked until one of this decoder's model
        answers, unless `check_model` had it; within `timeout_s` whoever else is asking (the calls shared
        by the caller's bearer `token`). Raises EncoderMismatch when the encoder that answered serves
        another model: the next part asks again, since with several encoders balanced the next answer
        may be another's (each reply is checked all the same); TimeoutError when `timeout_s` ran out,
        and the GetModelInfo call's own AioRpcError."""
        if self.model is not None:
            return self.model
        # Its own bound: a part joining a call that a part with more time started leaves at its own.
        async with asyncio.timeout(timeout_s):
            info, replica = await self._infos.fetch(
                token, timeout_s, lambda time_s: self._model_info(time_s, metadata), ran_out
            )
        mismatch = self.check.info_mismatch(info, replica)
        if mismatch is not None:
            raise EncoderMismatch(mismatch)
        self.model, self.embedder = info.model, info.embedder
        return self.model

    async def _model_info(
        self, timeout_s: float, metadata: tuple[tuple[str, str | bytes], ...]
    ) -> tuple[encoder_pb2.EncoderGetModelInfoResponse, str | None]:
        """The encoder's GetModelInfo reply, and the name of the replica that gave it, as it said."""
        call = self.client.stub.GetModelInfo(
            encoder_pb2.EncoderGetModelInfoRequest(), timeout=timeout_s, metadata=metadata
        )
        info = await call
        return info, replica_name.reported(await call.initial_metadata())

    def check_reply(
        self,
        reply: encoder_pb2.EmbedResponse,
        offer: encoder_pb2.SharedMemoryOffer | None,
        replica: str | None,  # the name of the replica that sent it, as it said: the refusal names it
    ) -> None:
        """Raises EncoderMismatch, naming both models, when `reply` is of another model than this
        decoder's, releasing the segment it may have written (as a read would): its rows are never read.
        A reply without a sample (an encoder from before replies carried one) passes: that encoder's
        model was checked once, by GetModelInfo (`check_model`, `name`), and never again."""
        mismatch = self.check.reply_mismatch(reply, replica)
        if mismatch is None:
            return
        if offer is not None:
            with contextlib.suppress(OSError):  # not this decoder's to remove: the refusal stands
                shared_memory.remove(self.shm_dir, offer.segment_name)
        raise EncoderMismatch(mismatch)
