"""A request body, from its bytes to the call it asks for: bounded, parsed, converted; a large one in a
worker process, so the gateway's event loop never parses it.

NOTE: why a process and not a thread. Python's JSON parser, base64 and protobuf hold the GIL for the
whole of a call, so a thread frees nothing: a 90 MB body of 3 million chat messages parsed "off the
loop" still kept /health silent for its 2.3 s. A worker process takes the body's bytes through a
pipe (written from the gateway's buffer, no copy) and gives back the converted call, its protobufs
serialized; what the parse and conversion cost stays in that process, which gives its heap back
after every body. At most `max_large_bodies` bodies are read or converted at once, at most
`max_large_bodies_per_caller` of them one caller's (`LargeBodies` below), so the workers' queue is
bounded by that too.
"""

from __future__ import annotations

import asyncio
import copyreg
import json
import multiprocessing
import multiprocessing.connection
import multiprocessing.context
import re
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tandem.client.errors import InvalidArgument, Unavailable
from tandem.client.memory import give_back
from tandem.client.pb.tandem.v1 import decoder_pb2, encoder_pb2
from tandem.gateway.body_limits import BodyLimits
from tandem.gateway.calls import EmbedCall, GenerateCall
from tandem.gateway.errors import HttpError, Refused

Convert = Callable[[dict[str, Any], BodyLimits], GenerateCall | EmbedCall]


# Python's refusal of an integer literal longer than sys.get_int_max_str_digits(), whose words end by
# telling the reader to raise that limit in their own interpreter: no advice for an HTTP caller.
_LONG_INTEGER = re.compile(r"\((\d+) digits\) for integer string conversion: value has (\d+) digits")


def parse(raw: bytes | bytearray) -> dict[str, Any]:
    """The body as a JSON object."""
    try:
        body = json.loads(raw)
    except ValueError as error:  # not JSON, or not UTF-8
        if (long := _LONG_INTEGER.search(str(error))) is not None:
            message = f"holds an integer of {long[2]} digits, over the {long[1]} a number may have"
            raise InvalidArgument("body", message) from None
        raise InvalidArgument("body", f"is not valid JSON: {error}") from None
    except RecursionError:  # '[' x 100,000
        raise InvalidArgument("body", "nests too deep") from None
    if not isinstance(body, dict):
        raise InvalidArgument("body", "must be a JSON object")
    return body


def convert(to_call: Convert, raw: bytes | bytearray, limits: BodyLimits) -> GenerateCall | EmbedCall:
    """`to_call` of the body in `raw` (its values already counted as it arrived: `count_values`), its
    fields counted before they are built (`body_limits.py`). Raises InvalidArgument naming the field."""
    body = parse(raw)
    try:
        return to_call(body, limits)
    except UnicodeEncodeError:  # Python's JSON parser lets lone UTF-16 surrogates ("\ud800") through
        raise InvalidArgument(
            "body", "holds a lone UTF-16 surrogate, which is not valid UTF-8 text"
        ) from None


class BodyWorkers:
    """Processes that convert large bodies, one body each at a time. A worker that dies (the kernel
    killed it for memory) is replaced, and the body it held answered 503.

    Each worker is spoken to over a pipe of its own: the body goes as raw bytes, written from the
    gateway's buffer (no pickled copy, which `ProcessPoolExecutor` would make and then keep alive in
    its feeder thread until the next call: +88 MB after a 93 MB body), and the converted call comes
    back pickled. The exchange runs on a thread, the pipe's reads and writes releasing the GIL."""

    def __init__(self, num_workers: int) -> None:
        self.num_workers = num_workers
        # spawn: the gateway runs gRPC's threads, which a forked child would inherit half-alive.
        self._context = multiprocessing.get_context("spawn")
        self._idle: asyncio.Queue[_Worker] = asyncio.Queue()
        self._workers: set[_Worker] = set()
        self._started: asyncio.Task[None] | None = None
        self._is_closed = False

    async def start(self) -> None:
        """Start every process (at the latest with the first large body: importing takes a second)."""
        if self._started is None:
            self._started = asyncio.ensure_future(self._start())
        await asyncio.shield(self._started)

    async def _start(self) -> None:
        for worker in await asyncio.gather(*(self._spawn() for _ in range(self.num_workers))):
            self._idle.put_nowait(worker)

    async def _spawn(self) -> _Worker:
        worker = await asyncio.to_thread(_Worker, self._context)
        self._workers.add(worker)
        return worker

    async def convert(
        self, to_call: Convert, raw: bytes | bytearray, limits: BodyLimits
    ) -> GenerateCall | EmbedCall:
        """`convert(to_call, raw, limits)` in a worker. Shielded: a caller that leaves meanwhile does not
        hand the worker back before its exchange has ended."""
        await self.start()
        worker = await self._idle.get()
        exchange = asyncio.ensure_future(self._exchange(worker, to_call, raw, limits))
        outcome = await asyncio.shield(exchange)
        # Raised here, not in the task: a task keeps its exception, and with it the traceback's frames
        # and the body they hold, until the cyclic GC frees the task.
        if outcome.refusal is not None:
            raise InvalidArgument(*outcome.refusal)
        if outcome.has_died:
            raise Unavailable("the process converting this body died (out of memory?); retry")
        if outcome.failure is not None:
            raise RuntimeError(f"a body worker failed: {outcome.failure}")
        assert outcome.call is not None
        return outcome.call

    async def _exchange(
        self, worker: _Worker, to_call: Convert, raw: bytes | bytearray, limits: BodyLimits
    ) -> _Outcome:
        try:
            outcome = await asyncio.to_thread(worker.convert, to_call, raw, limits)
        except (EOFError, OSError):  # the pipe broke: the process is gone
            self._workers.discard(worker)
            worker.close()
            if not self._is_closed:
                self._idle.put_nowait(await self._spawn())
            return _Outcome(has_died=True)
        self._idle.put_nowait(worker)
        return outcome

    def close(self) -> None:
        self._is_closed = True
        for worker in self._workers:
            worker.close()
        self._workers.clear()


@dataclass(frozen=True)
class _Outcome:
    """What a worker sends back for a body: its call, or why there is none."""

    call: GenerateCall | EmbedCall | None = None
    refusal: tuple[str, str] | None = None  # the InvalidArgument raised: its field and description
    failure: str | None = None  # anything else raised (a bug: a 500), its traceback; the worker lives on
    has_died: bool = False  # the worker died on it (set by the gateway: a 503, the worker replaced)


class _Worker:
    """One worker process and its end of the pipe."""

    def __init__(self, context: multiprocessing.context.SpawnContext) -> None:
        self._connection, theirs = context.Pipe()
        self._process = context.Process(target=_serve, args=(theirs,), daemon=True, name="tandem-body-worker")
        self._process.start()
        theirs.close()

    def convert(self, to_call: Convert, raw: bytes | bytearray, limits: BodyLimits) -> _Outcome:
        self._connection.send((to_call, limits))
        self._connection.send_bytes(raw)
        return self._connection.recv()

    def close(self) -> None:
        self._connection.close()
        self._process.kill()
        self._process.join(5)


def _serve(connection: multiprocessing.connection.Connection) -> None:
    """A worker's life: a body at a time, its outcome sent back, the heap the body took given back to
    the OS (tandem.client.memory)."""
    while True:
        try:
            to_call, limits = connection.recv()
        except EOFError:  # the gateway closed the pipe or exited
            return
        raw = connection.recv_bytes()
        try:
            outcome = _Outcome(call=convert(to_call, raw, limits))
        except InvalidArgument as error:
            outcome = _Outcome(refusal=(error.field, error.description))
        except Exception:
            outcome = _Outcome(failure=traceback.format_exc())
        del raw
        connection.send(outcome)
        del outcome
        give_back()


# Across the pipe: protobuf messages as their bytes (the generated classes do not pickle).
def _generate_request(data: bytes) -> decoder_pb2.GenerateRequest:
    return decoder_pb2.GenerateRequest.FromString(data)


def _embed_request(data: bytes) -> encoder_pb2.EmbedRequest:
    return encoder_pb2.EmbedRequest.FromString(data)


copyreg.pickle(decoder_pb2.GenerateRequest, lambda m: (_generate_request, (m.SerializeToString(),)))
copyreg.pickle(encoder_pb2.EmbedRequest, lambda m: (_embed_request, (m.SerializeToString(),)))


class LargeBodies:
    """At most `max_bodies` large bodies read, converted or answered at once: their bytes are the
    gateway's memory; and at most `max_per_caller` of them one caller's (`callers.caller_of`), so that
    one caller holding its share (bodies it never finishes sending) leaves the rest to the others, as
    nginx's limit_conn per key does. Event-loop thread only."""

    def __init__(self, max_bodies: int, max_per_caller: int) -> None:
        self.max_bodies = max_bodies
        self.max_per_caller = max_per_caller
        self.num_held = 0
        self._held: Counter[str] = Counter()  # places per caller; callers holding none are not kept

    def take(self, caller: str) -> LargeBody:
        """A place for one large body of `caller`: Refused with 429 when the caller holds its share,
        503 when no place is free (both with Retry-After)."""
        if self._held[caller] >= self.max_per_caller:
            message = (
                f"this caller has {self._held[caller]} large bodies being read, converted or answered, its "
                "share of them (--max-large-bodies-per-caller); retry once one has ended"
            )
            raise Refused(HttpError(429, "rate_limit_error", message, retry_after_s=1.0))
        if self.num_held >= self.max_bodies:
            message = f"the gateway is handling {self.max_bodies} large bodies (--max-large-bodies); retry"
            raise Refused(HttpError(503, "service_unavailable", message, retry_after_s=1.0))
        self.num_held += 1
        self._held[caller] += 1
        return LargeBody(self, caller)

    def _release(self, caller: str) -> None:
        self.num_held -= 1
        self._held[caller] -= 1
        if not self._held[caller]:
            del self._held[caller]


class LargeBody:
    """One large body's place, held until `release` (idempotent)."""

    def __init__(self, owner: LargeBodies, caller: str) -> None:
        self._owner: LargeBodies | None = owner
        self._caller = caller

    def release(self) -> None:
        if self._owner is not None:
            self._owner._release(self._caller)
            self._owner = None
