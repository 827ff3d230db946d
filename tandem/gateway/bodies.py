"""A request body, from its bytes to the call it asks for: bounded, parsed, converted; a large one in a
worker process, so the gateway's event loop never parses it.

NOTE: why a process and not a thread. Python's JSON parser, base64 and protobuf hold the GIL for the
whole of a call, so a thread frees nothing: a 90 MB body of 3 million chat messages parsed "off the
loop" still kept /health silent for its 2.3 s. A worker process takes the body's bytes (one copy
through a pipe, about 20 ms for 90 MB) and gives back the converted call, its protobufs serialized;
what the parse and conversion cost stays in that process, which gives its heap back after every
large body. At most `max_large_bodies` bodies are read or converted at once (the gateway's
`LargeBodies`), so the workers' queue is bounded by that too.
"""

from __future__ import annotations

import asyncio
import copyreg
import json
import multiprocessing
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from tandem.client.errors import InvalidArgument, Unavailable
from tandem.client.memory import give_back
from tandem.client.pb.tandem.v1 import decoder_pb2, encoder_pb2
from tandem.gateway.body_limits import BodyLimits, check_values
from tandem.gateway.errors import HttpError, Refused
from tandem.gateway.requests import EmbedCall, GenerateCall

Convert = Callable[[dict[str, Any], BodyLimits], GenerateCall | EmbedCall]


def parse(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object."""
    try:
        body = json.loads(raw)
    except ValueError as error:  # not JSON, or not UTF-8
        raise InvalidArgument("body", f"is not valid JSON: {error}") from None
    except RecursionError:  # '[' x 100,000
        raise InvalidArgument("body", "nests too deep") from None
    if not isinstance(body, dict):
        raise InvalidArgument("body", "must be a JSON object")
    return body


def convert(to_call: Convert, raw: bytes, limits: BodyLimits) -> GenerateCall | EmbedCall:
    """`to_call` of the body in `raw`: its values counted before it is parsed, its fields before they
    are built (`body_limits.py`). Raises InvalidArgument naming the field."""
    check_values(raw, limits)
    body = parse(raw)
    try:
        return to_call(body, limits)
    except UnicodeEncodeError:  # Python's JSON parser lets lone UTF-16 surrogates ("\ud800") through
        raise InvalidArgument(
            "body", "holds a lone UTF-16 surrogate, which is not valid UTF-8 text"
        ) from None


class BodyWorkers:
    """Processes that convert large bodies. Started with the gateway; a pool that lost a process (the
    kernel killed it for memory) is replaced, and the body it held answered 503."""

    def __init__(self, num_workers: int) -> None:
        self.num_workers = num_workers
        self._pool = self._new_pool()

    def _new_pool(self) -> ProcessPoolExecutor:
        # spawn: the gateway runs gRPC's threads, which a forked child would inherit half-alive.
        return ProcessPoolExecutor(self.num_workers, mp_context=multiprocessing.get_context("spawn"))

    async def start(self) -> None:
        """Start every process now, so that the first large body does not wait for one to import."""
        loop = asyncio.get_running_loop()
        await asyncio.gather(*(loop.run_in_executor(self._pool, int) for _ in range(self.num_workers)))

    async def convert(self, to_call: Convert, raw: bytes, limits: BodyLimits) -> GenerateCall | EmbedCall:
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._pool, _convert_and_give_back, to_call, raw, limits)
        except BrokenProcessPool:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = self._new_pool()
            raise Unavailable("the process converting this body died (out of memory?); retry") from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _convert_and_give_back(to_call: Convert, raw: bytes, limits: BodyLimits) -> GenerateCall | EmbedCall:
    """In a worker: `convert`, then the heap the body took back to the OS (tandem/client/memory.py)."""
    try:
        return convert(to_call, raw, limits)
    finally:
        give_back()  # the parse's small objects; `raw` itself is one mapping, unmapped when freed


# Across the pipe: protobuf messages as their bytes (the generated classes do not pickle), and the
# InvalidArgument a worker raises with its field.
def _generate_request(data: bytes) -> decoder_pb2.GenerateRequest:
    return decoder_pb2.GenerateRequest.FromString(data)


def _embed_request(data: bytes) -> encoder_pb2.EmbedRequest:
    return encoder_pb2.EmbedRequest.FromString(data)


def _invalid_argument(field: str, description: str) -> InvalidArgument:
    return InvalidArgument(field, description)


copyreg.pickle(decoder_pb2.GenerateRequest, lambda m: (_generate_request, (m.SerializeToString(),)))
copyreg.pickle(encoder_pb2.EmbedRequest, lambda m: (_embed_request, (m.SerializeToString(),)))
copyreg.pickle(InvalidArgument, lambda e: (_invalid_argument, (e.field, e.description)))


class LargeBodies:
    """At most `max_bodies` large bodies read, converted or answered at once: their bytes are the
    gateway's memory. Event-loop thread only."""

    def __init__(self, max_bodies: int) -> None:
        self.max_bodies = max_bodies
        self.num_held = 0

    def take(self) -> LargeBody:
        """A place for one large body; Refused (503 with Retry-After) when none is free."""
        if self.num_held >= self.max_bodies:
            message = f"the gateway is handling {self.max_bodies} large bodies (--max-large-bodies); retry"
            raise Refused(HttpError(503, "service_unavailable", message, retry_after_s=1.0))
        self.num_held += 1
        return LargeBody(self)


class LargeBody:
    """One large body's place, held until `release` (idempotent)."""

    def __init__(self, owner: LargeBodies) -> None:
        self._owner: LargeBodies | None = owner

    def release(self) -> None:
        if self._owner is not None:
            self._owner.num_held -= 1
            self._owner = None
