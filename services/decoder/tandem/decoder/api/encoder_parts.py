"""The decoder's encoder: it fetches the rows of its requests' `encoder` parts itself.

A decoder started with `--encoder ADDR` (several addresses, or `dns:///`, balanced as the clients
balance them: `tandem.client.channel`) starts one fetch per encoder part as soon as a Generate call
is converted; the request is built meanwhile on its own thread, which waits for the rows only once
everything else is checked and tokenized (`engine/admission/prompt.py`). So the rows never travel through the
caller: an image's bytes come in, its rows go from the encoder to the decoder directly.

A fetch, on the event loop:
1. The embedding cache (`embedding_cache.py`): an input seen recently, for the same encoder model and
   dtype, is not embedded again.
   An input already being fetched is not embedded again either: the cache is filled only when a fetch
   returns, so n calls asking for one picture at once (a chat with n choices, or one prompt holding it
   twice) would each miss it. A fetch for a key in flight joins that fetch (`shared_fetches.py`) and is
   handed its rows, or its error named on the joiner's own field. Keyed with the caller's bearer token
   too: a refusal of one caller's token is never handed to another caller. A joiner leaving does not
   cancel the others' fetch; the Embed call is cancelled only when every one waiting for it has left.
   A fetch that ran out of its first caller's deadline is fetched again by a joiner that still has time.
2. An Embed call with the caller's deadline (at most MAX_FETCH_S), bearer token and trace context
   (the telemetry's interceptor carries the decoder's span; without it the caller's own
   `traceparent` is passed on, when well formed: trace_context.py), asking for the model's dtype, so
   the rows need no cast here, and one row per position (POOLING_NONE, whatever the encoder's
   --pooling). Where this decoder could make its probe file, the call offers shared memory
   (`tandem.common.torch_part.shared_memory`): an encoder on the same host writes the rows into the
   segment the offer named, and any other encoder ignores the offer and sends bytes. Negotiated per
   call, never configured. At most MAX_EMBEDS_IN_FLIGHT calls run at once, the others wait their turn
   within their deadline: a gRPC server at its defaults cancels at random the calls past the first
   1,000 it has not yet taken up (grpc.server.max_pending_requests; Tandem's encoder now holds
   10,000, tandem.common.server), so one request of 2,000 encoder parts failed UNAVAILABLE
   "CANCELLED", blaming a healthy encoder, and the encoder runs batches of 8 anyway.
   At most MAX_FETCHES_PER_CALL of one Generate call's parts fetch at once (its others wait, within
   its deadline, holding nothing): the calls in flight are handed out first come, first served, so
   one call of hundreds of pictures queued all of them ahead of everyone, and a one-picture call
   behind it waited for all of them, or ran out of its deadline.
3. The reply: a handle is read only if it names the segment this call asked for; the segment is
   opened, checked (dtype, shape, bounds), its rows copied into this process (through this decoder's
   mapping of the encoder's pool segment, made the first time it is given one and kept:
   `shm_segment_maps.SegmentMaps`; all of it on a thread, whatever the rows' size, since the mapping's
   cost is the whole pool segment's) and their digest checked under this call's key
   (`tensors.decode_shared`; the copy and the digest are one pass in C where the CPU has carry-less
   multiplication: `backends/cpu/copy_digest.py`), and the name removed: that releases the segment to
   the encoder's pool, which writes into it again, and a replay finds nothing. Bytes are decoded as
   any tensor (zero copy). A segment gone, or changed, before it was read (its lease,
   --shared-memory-lease-s, ran out while this decoder was busy: this host's timing, not the caller's
   input; or one that cannot be opened) is fetched once more without the offer, its rows by value;
   only if that fails too is the part refused, UNAVAILABLE blaming the encoder. A reply wrong in itself
   (a segment not asked for, rows past their segment, a wrong dtype or shape, NaN) is UNAVAILABLE
   blaming the encoder, naming the fault: never INVALID_ARGUMENT on the caller's field (no handle passed).
Which model the encoder serves is checked against this decoder's own, by a sample of each one's token
table (`tandem.common.torch_part.model_identity`; compared in `encoder_model_check.py`), whose rows it
would otherwise read in the wrong hidden space: once loaded, the decoder asks (GetModelInfo:
`check_model`, waiting a while for an encoder still loading) and refuses to start beside another model
of the same shape; and every Embed reply carries its model's sample, checked before its rows are read or
cached (`encoder_model.py`). Once was not enough: `--encoder good,wrong` is balanced, and the start-up check
asked one of the two, after which half the parts were the other's rows, served OK; an encoder restarted
on its port with another checkpoint was never noticed. A reply of another model is FAILED_PRECONDITION
on the part, naming both models, and its rows are never used. An encoder that did not answer at start is
asked its model's name (part of every cache key) when first asked for rows (parts asking meanwhile share
one call, each waiting at most its own time), and the part refused if it serves another model.
Errors name the part: the encoder's refusal of the input is INVALID_ARGUMENT (or FAILED_PRECONDITION)
on `prompt[i].encoder`, as are rows larger than this decoder's --max-message-bytes, whether they came
as bytes (over gRPC's receive cap) or through shared memory, and any Embed request or reply over the
--max-message-bytes of either side (named: `encoder_over_cap.py`); an encoder that cannot be reached is
UNAVAILABLE "the encoder could not be reached (no connection, or it was lost); retry", within the
retries of its channel, so the request never waits for it past its deadline, and so is one that did
not answer within MAX_FETCH_S when the caller's own deadline was later (another replica may serve it;
DEADLINE_EXCEEDED is for the caller's deadline).
A caller's error never names the encoder's address: the gateway passes the decoder's status on to HTTP
callers, and "encoder 10.0.0.5:50052 could not be reached" showed them this deployment's internal
addresses. The operator's WARNING line names it (`encoder_errors.py`), with gRPC's own words or the
encoder's, once in a while for each kind of failure, encoder and code: with several encoders balanced,
the replica that took the call, as it said when the call began (`tandem.common.replica_name`), the whole
list only where none did (every one unreachable).
A call that ends (cancelled, failed, finished) cancels its fetches still running; the request being
built then fails, and an Embed call cancelled (or failed) before its reply was read removes the name
it asked for, as a read does, releasing the segment to the encoder's pool if the encoder wrote it: a
caller cancelling its calls cannot keep the pool leased. (A name the encoder links after that, its
batch still running when the cancel came, is freed by the encoder's lease.)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import grpc
import torch

from tandem.client import telemetry as otel
from tandem.client.client import EncoderClient
from tandem.client.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    TandemError,
    Unavailable,
)
from tandem.client.over_cap import over_cap
from tandem.client.pb.tandem.v1 import encoder_pb2
from tandem.common import replica_name
from tandem.common.torch_part import shared_memory, tensors
from tandem.common.torch_part.model_identity import read_table_sample
from tandem.common.torch_part.prompt_parts import EncoderPrompt
from tandem.decoder.api.embed_replies import EmbedReplies, SegmentLost
from tandem.decoder.api.embedding_cache import EmbeddingCache, cache_key
from tandem.decoder.api.encoder_errors import EncoderErrors, Failure
from tandem.decoder.api.encoder_faults import NoPlace, encoder_named, ran_out, unavailable
from tandem.decoder.api.encoder_model import EncoderMismatch, EncoderModel
from tandem.decoder.api.encoder_model_check import EncoderModelCheck
from tandem.decoder.api.encoder_over_cap import rows_too_large
from tandem.decoder.api.shared_fetches import SharedFetches
from tandem.decoder.api.spec_encoder_parts import with_encoder_parts
from tandem.decoder.api.trace_context import trace_context
from tandem.decoder.engine.admission.prompt import GenerateSpec

log = logging.getLogger(__name__)

MAX_FETCH_S = 60.0  # an Embed call without a caller's deadline: a vision tower takes well under a second
MAX_EMBEDS_IN_FLIGHT = 64  # Embed calls running at once, all requests together (see step 2)
MAX_FETCHES_PER_CALL = 16  # of one Generate call's parts, fetching at once (see step 2)
FORWARDED_METADATA = ("authorization",)  # the caller's token: the encoder's per-token bounds see it
# Embedders that tokenize with the checkpoint's own tokenizer, the decoder's: a part's unpooled rows are
# one per position its input takes in the prompt (a soft prompt's virtual rows more). A projector
# tokenizes with its encoder's own (MiniLM's WordPiece: a long word is one [UNK]).
SAME_TOKENIZER = frozenset({"lookup", "soft-prompt"})


class EncoderParts:
    def __init__(
        self,
        address: str,
        dtype: torch.dtype,  # the model's: the rows are asked for in it
        max_message_bytes: int,
        cache_bytes: int,
        telemetry: otel.Telemetry | None = None,
        shm_dir: Path = shared_memory.SHM_DIR,
        # This decoder's checkpoint, and the name it serves it under: an encoder of another model is
        # refused. None: not checked (tests and benchmarks that build an encoder and a decoder of one
        # model by hand).
        model_dir: Path | None = None,
        model_name: str = "",
        # The model's hidden size (its config's, as loaded): rows of another width are the encoder's
        # fault, refused before they are cached. None: checked only at admission (tests built by hand).
        hidden_size: int | None = None,
    ) -> None:
        self.address = address
        self.dtype = dtype
        self.max_message_bytes = max_message_bytes
        model_check = EncoderModelCheck(
            address,
            read_table_sample(model_dir, ValueError) if model_dir is not None else None,
            model_dir,
            model_name,
        )
        self.cache = EmbeddingCache(cache_bytes)
        self.shm_dir = shm_dir
        # The replies' probe (a file, a locked descriptor, a sweeper's thread) before the channel, whose
        # close is a coroutine: made the other way round, an EmbedReplies that raised left the channel
        # open, nothing returned to close it.
        self.replies = EmbedReplies(dtype, hidden_size, max_message_bytes, shm_dir)
        try:
            self.client = EncoderClient(address, max_message_bytes, telemetry)
        except BaseException:
            self.replies.close()
            raise
        self.encoder_model = EncoderModel(address, self.client, model_check, shm_dir)
        self._traces_itself = telemetry is not None and telemetry.is_tracing
        # The fetches running, by cache key and the caller's bearer token: a fetch of one joins them.
        self.fetches: SharedFetches[torch.Tensor] = SharedFetches()
        self._in_flight = asyncio.Semaphore(MAX_EMBEDS_IN_FLIGHT)  # Embed calls running (step 2)
        self.num_refetched = 0  # fetched again by value: their segment was lost before it was read
        self.errors = EncoderErrors(address, max_message_bytes, log)

    async def close(self) -> None:
        self.replies.close()
        await self.client.close()

    @property
    def num_shared(self) -> int:  # replies read from shared memory
        return self.replies.num_shared

    @property
    def num_bytes(self) -> int:  # replies that carried their rows as bytes
        return self.replies.num_bytes

    def start(
        self,
        spec: GenerateSpec,
        metadata: Sequence[tuple[str, str | bytes]] | None,
        time_remaining_s: float | None,
        check: Callable[[GenerateSpec], object] | None = None,
    ) -> tuple[GenerateSpec, list[asyncio.Task]]:
        """`spec` with a fetch started for each encoder part (its `rows` settle with it), and the
        fetches, which the caller cancels when its call ends. `check` (raising to refuse: the build's
        rules that read no position, prompt.check_spec) is handed the spec first, each encoder part
        counted as its rows will come (`counts_as_input`), where it has encoder parts: a call those rules
        refuse never reaches the encoder."""
        counts_as_input = self.encoder_model.embedder in SAME_TOKENIZER
        to_fetch: list[tuple[EncoderPrompt, str, concurrent.futures.Future[torch.Tensor]]] = []

        def counted(part: EncoderPrompt, field: str) -> EncoderPrompt:
            # One pass: the rows' future now, its fetch only once `check` has passed the spec.
            rows: concurrent.futures.Future[torch.Tensor] = concurrent.futures.Future()
            part = dataclasses.replace(part, rows=rows, counts_as_input=counts_as_input)
            to_fetch.append((part, field, rows))
            return part

        fetching = with_encoder_parts(spec, counted)
        if fetching is None:
            return spec, []
        if check is not None:
            check(fetching)
        timeout_s = MAX_FETCH_S if time_remaining_s is None else min(MAX_FETCH_S, time_remaining_s)
        # Whether the fetch ends at this decoder's cap rather than the caller's deadline: running out
        # then is the encoder's silence, not the caller's time (see `_error`).
        is_capped = time_remaining_s is None or time_remaining_s > MAX_FETCH_S
        forwarded = self._forwarded(metadata or ())
        tasks: list[asyncio.Task] = []
        share = asyncio.Semaphore(MAX_FETCHES_PER_CALL)  # this call's parts fetching at once
        for part, field, rows in to_fetch:
            task = asyncio.ensure_future(
                self._fetch(part, f"{field}.encoder", rows, timeout_s, is_capped, forwarded, share)
            )
            # A task cancelled before it ran never enters _fetch: its rows settle here all the same.
            task.add_done_callback(functools.partial(_cancel_unless_settled, rows))
            tasks.append(task)
        return fetching, tasks

    def _forwarded(self, metadata: Sequence[tuple[str, str | bytes]]) -> tuple[tuple[str, str | bytes], ...]:
        forwarded = tuple((key, value) for key, value in metadata if key in FORWARDED_METADATA)
        return forwarded if self._traces_itself else forwarded + trace_context(metadata)

    async def _fetch(
        self,
        part: EncoderPrompt,
        field: str,
        rows: concurrent.futures.Future[torch.Tensor],
        timeout_s: float,
        is_capped: bool,
        metadata: tuple[tuple[str, str | bytes], ...],
        share: asyncio.Semaphore,
    ) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        try:
            try:
                async with asyncio.timeout_at(deadline):
                    await share.acquire()
            except TimeoutError:
                raise DeadlineExceeded(
                    f"{field}: the deadline passed while the call's other encoder parts were fetched "
                    f"({MAX_FETCHES_PER_CALL} at a time)"
                ) from None
            try:
                result = await self._rows(part, field, max(0.0, deadline - loop.time()), is_capped, metadata)
            finally:
                share.release()
        except asyncio.CancelledError:
            rows.cancel()
            raise
        except Exception as error:
            if not rows.done():
                rows.set_exception(error)
        else:
            if not rows.done():
                rows.set_result(result)

    async def _rows(
        self,
        part: EncoderPrompt,
        field: str,
        timeout_s: float,
        is_capped: bool,
        metadata: tuple[tuple[str, str | bytes], ...],
    ) -> torch.Tensor:
        """[n, hidden_size] in the model's dtype: cached, or fetched (and then cached), the fetch shared
        with every other one of the same input and bearer token running meanwhile (`shared_fetches.py`),
        its errors named on `field`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        model = await self._encoder_model(field, timeout_s, is_capped, metadata)
        timeout_s = max(0.0, deadline - loop.time())  # the model's name may have taken some of it
        key = cache_key(model, part.kind, part.content, self.dtype)
        cached = self.cache.get(key)
        if cached is not None:
            return cached
        token = tuple(value for name, value in metadata if name in FORWARDED_METADATA)
        try:
            return await self.fetches.fetch(
                (key, token), timeout_s, lambda time_s: self._embed(part, key, time_s, metadata), ran_out
            )
        except grpc.aio.AioRpcError as error:
            raise self._error(error, field, is_capped, part.kind) from None
        except NoPlace:
            raise self._no_place(field, is_capped) from None
        except EncoderMismatch as error:
            raise self._other_model(field, error) from None
        except (InvalidArgument, FailedPrecondition) as error:
            raise type(error)(field + error.field, error.description, info=error.info) from None

    async def _embed(
        self, part: EncoderPrompt, key: bytes, timeout_s: float, metadata: tuple[tuple[str, str | bytes], ...]
    ) -> torch.Tensor:
        """The Embed call of one fetch, shared by everyone waiting for it: the rows, put in the cache.
        Raises the encoder's AioRpcError as it came, and errors about the reply on fields relative to the
        part (`.shared_embeddings.name`), which each waiter names on its own field."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        offer = self.replies.offer()
        reply, replica = await self._call(part, offer, deadline, metadata)
        self.encoder_model.check_reply(reply, offer, replica)
        try:
            result = await self.replies.read(reply, offer)
        except SegmentLost as lost:
            # The encoder's lease ran out before this decoder read its rows (a busy decoder, a short
            # --shared-memory-lease-s): this host's timing, not the caller's input. Once more, by value.
            self.num_refetched += 1
            try:
                again, replica = await self._call(part, None, deadline, metadata)
                self.encoder_model.check_reply(again, None, replica)
                result = await self.replies.read(again, None)
            except tensors.TooManyElements as error:
                raise InvalidArgument("", rows_too_large(self.max_message_bytes, error.description)) from None
            except grpc.aio.AioRpcError as error:
                if ran_out(error) or over_cap(error) is not None:
                    raise
                raise unavailable(
                    f"{lost}; fetched again by value: {error.code().name}: {error.details()}",
                    replica_name.reported(error.initial_metadata()),
                ) from None
            except (InvalidArgument, FailedPrecondition) as error:
                raise unavailable(f"{lost}; fetched again by value, its reply's {error}", replica) from None
        except tensors.TooManyElements as error:
            # More rows than this decoder's --max-message-bytes holds (an encoder allowed larger
            # messages, and shared memory passes gRPC's receive cap): the caller's input is too long,
            # which no retry mends, so INVALID_ARGUMENT on the caller's field, as rows sent as bytes
            # over that cap are (`encoder_errors.py`).
            raise InvalidArgument("", rows_too_large(self.max_message_bytes, error.description)) from None
        except InvalidArgument as error:
            # A reply wrong in itself (a segment this call did not ask for, rows past their segment, a
            # dtype or shape not the rows', NaN): the encoder's fault, never the caller's input (callers
            # pass no handles). It was INVALID_ARGUMENT on the caller's prompt[i].encoder.*.
            raise unavailable(f"its reply's {error}", replica) from None
        self.cache.put(key, result)
        return result

    async def _call(
        self,
        part: EncoderPrompt,
        offer: encoder_pb2.SharedMemoryOffer | None,
        deadline: float,
        metadata: tuple[tuple[str, str | bytes], ...],
    ) -> tuple[encoder_pb2.EmbedResponse, str | None]:
        """The Embed call for `part`, offering shared memory when `offer` is given, and the name of the
        replica that answered, as it said (`replica_name`; None: it did not). A call that does not
        return its reply here (cancelled: its caller left; or failed) releases the segment it asked
        for, as a read does, in case the encoder wrote it: else a caller cancelling its calls kept
        the encoder's pool leased for --shared-memory-lease-s each (10 s), and others got bytes."""
        # One row per position, as EncoderInput promises, whatever the encoder's --pooling: its default
        # applied to a request that left pooling unset, and one pooled row stood for the whole input.
        request = encoder_pb2.EmbedRequest(
            output_dtype=tensors.to_wire_dtype(self.dtype), pooling=encoder_pb2.POOLING_NONE
        )
        if part.kind == "text":
            request.text = part.content  # type: ignore[assignment]
        elif part.kind == "token_ids":
            request.token_ids.ids.extend(part.content)  # type: ignore[arg-type]
        else:
            request.image.data = part.content  # type: ignore[assignment]
        if offer is not None:
            request.shared_memory.CopyFrom(offer)
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout_at(deadline):
                await self._in_flight.acquire()
        except TimeoutError:
            raise NoPlace from None
        try:
            call = self.client.stub.Embed(
                request, timeout=max(0.0, deadline - loop.time()), metadata=metadata
            )
            reply = await call
            return reply, replica_name.reported(await call.initial_metadata())
        except BaseException:
            if offer is not None:
                shared_memory.remove(self.shm_dir, offer.segment_name)
            raise
        finally:
            self._in_flight.release()

    async def check_model(self, wait_s: float) -> str:
        """The encoder's model checked at start: `EncoderModel.check_model`."""
        return await self.encoder_model.check_model(wait_s)

    async def _encoder_model(
        self, field: str, timeout_s: float, is_capped: bool, metadata: tuple[tuple[str, str | bytes], ...]
    ) -> str:
        """The encoder's model name (every cache key holds it): `EncoderModel.name`, its errors named
        on `field`. FailedPrecondition when the encoder that answered serves another model."""
        token = tuple(value for name, value in metadata if name in FORWARDED_METADATA)
        try:
            return await self.encoder_model.name(token, timeout_s, metadata)
        except TimeoutError:  # this part's own time, the call perhaps running on for another's
            raise self._out_of_time(field, is_capped, "asked which model it serves") from None
        except grpc.aio.AioRpcError as error:
            if ran_out(error):
                raise self._out_of_time(
                    field, is_capped, "asked which model it serves", encoder_named(self.address, error)
                ) from None
            raise self._error(error, field, is_capped) from None
        except EncoderMismatch as error:
            raise self._other_model(field, error) from None

    def _other_model(self, field: str, error: EncoderMismatch) -> FailedPrecondition:
        """An encoder of another model, in a caller's words (the two models); the operator's line names
        the encoder that answered and this decoder's checkpoint."""
        self.errors.warn(Failure.OTHER_MODEL, self.address, grpc.StatusCode.FAILED_PRECONDITION, str(error))
        return FailedPrecondition(field, error.told)

    def _out_of_time(self, field: str, is_capped: bool, doing: str, who: str | None = None) -> TandemError:
        """A call to the encoder (`who`, the replica that took it where known) that ran out of time while
        the encoder was `doing` something."""
        who = who or self.address
        if is_capped:
            # The caller would have waited longer: an encoder silent this long (hung, stopped) is
            # unavailable, and another replica may serve the retry. It was DEADLINE_EXCEEDED at
            # 60 s on a call whose own deadline was 120 s.
            code = grpc.StatusCode.UNAVAILABLE
            self.errors.warn(
                Failure.SILENT,
                who,
                code,
                f"encoder {who} did not answer within {MAX_FETCH_S:g} s, this decoder's cap on a fetch",
            )
            return Unavailable(f"{field}: the encoder did not answer within {MAX_FETCH_S:g} s; retry")
        code = grpc.StatusCode.DEADLINE_EXCEEDED
        self.errors.warn(Failure.SILENT, who, code, f"a caller's deadline passed while encoder {who} {doing}")
        return DeadlineExceeded(f"{field}: the deadline passed while the encoder {doing}")

    def _no_place(self, field: str, is_capped: bool) -> TandemError:
        """A part whose Embed call never got one of the MAX_EMBEDS_IN_FLIGHT places within its time.
        It read "encoder ... did not answer within 60 s", of an encoder never called."""
        limit = f"this decoder's limit of {MAX_EMBEDS_IN_FLIGHT} Embed calls in flight"
        held = "the encoder holds them all, so this part's was never sent"
        code = grpc.StatusCode.UNAVAILABLE if is_capped else grpc.StatusCode.DEADLINE_EXCEEDED
        self.errors.warn(
            Failure.NO_PLACE,
            self.address,
            code,
            f"{limit} was full for an encoder part's whole time, encoder {self.address} holding them all",
        )
        if is_capped:  # as the encoder's silence (`_out_of_time`): another replica may serve the retry
            return Unavailable(f"{field}: {limit} was full for {MAX_FETCH_S:g} s ({held})")
        return DeadlineExceeded(f"{field}: the deadline passed while {limit} was full ({held})")

    def _error(
        self, error: grpc.aio.AioRpcError, field: str, is_capped: bool, sent: str | None = None
    ) -> TandemError:
        """The encoder's status as this call's (`EncoderErrors.named`), but for DEADLINE_EXCEEDED: this
        fetch's time ran out, and `is_capped` says whether it was this decoder's MAX_FETCH_S, not the
        caller's deadline."""
        if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return self._out_of_time(field, is_capped, "embedded it", encoder_named(self.address, error))
        return self.errors.named(error, field, sent)


def _cancel_unless_settled(rows: concurrent.futures.Future[torch.Tensor], task: asyncio.Task) -> None:
    if task.cancelled():
        rows.cancel()
