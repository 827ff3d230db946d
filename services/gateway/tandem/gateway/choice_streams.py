"""A request's Generate streams, one per choice, as one: every call started at once, each one's first
event awaited before the answer begins, then their events merged in the order they arrive.

NOTE: whole or nothing. The decoder refuses a request (a prompt too long, a token ID out of range)
before its first event, so awaiting every choice's first event (`start`) lets one refused choice
still be an HTTP error, before any byte of a stream is written. The first choice to fail, then or
later, fails the request, and every other call is cancelled (`close`, which the handler always
calls: it is also what a caller's disconnect reaches, the handler being cancelled); a cancelled call
frees its request's KV blocks in the decoder. The events of several calls meet in a bounded queue,
so a reader ahead of a slow HTTP caller waits, and its gRPC stream with it (flow control), as a lone
call waits for the caller itself; a lone call is read directly, with no queue or task between.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import grpc

from tandem.client.pb.tandem.v1 import decoder_pb2, decoder_pb2_grpc
from tandem.gateway.choices import Choice
from tandem.gateway.errors import BodyNames, HttpError, from_grpc
from tandem.gateway.prompt_budget import entries_held, refusal_of_request
from tandem.gateway.tasks import all_or_cancel

EVENTS_PER_CHOICE = 4  # events a choice's reader may queue ahead of the HTTP caller


class ChoiceFailed(Exception):
    """A choice's Generate call ended with an error status: the request's error."""

    def __init__(self, choice: Choice, error: grpc.aio.AioRpcError, held_by_request: int = 0) -> None:
        super().__init__(error.details())
        self.choice = choice
        self.error = error
        # The fewest prompt-logprob entries the request's other choices hold in the decoder (`prompt_budget`).
        self.held_by_request = held_by_request

    def http_error(self, names: BodyNames, is_batch: bool) -> HttpError:
        """The error in OpenAI's shape, named as the body names its fields; in a batch, after the
        prompt that failed (`prompt[2]`)."""
        error = refusal_of_request(self.error, from_grpc(self.error, names), self.held_by_request)
        return error.for_prompt(self.choice.prompt_index) if is_batch else error


class ChoiceStreams:
    """The Generate calls of `choices` on `stub`, started when built. Event-loop thread only."""

    def __init__(
        self,
        stub: decoder_pb2_grpc.DecoderStub,
        choices: Sequence[Choice],
        metadata: tuple[tuple[str, str], ...] | None,
    ) -> None:
        self.choices = choices
        self._calls = [stub.Generate(choice.request, metadata=metadata) for choice in choices]
        self._iterators = [call.__aiter__() for call in self._calls]
        self._firsts: list[decoder_pb2.GenerateResponse | None] = []  # each call's first event
        self._accepted: dict[int, int] = {}  # the prompt tokens of each call accepted so far
        self._readers: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        """Every call's first event (the decoder's `accepted`); ChoiceFailed for the first refusal."""

        async def first(k: int) -> decoder_pb2.GenerateResponse | None:
            try:
                event = await anext(self._iterators[k], None)
            except grpc.aio.AioRpcError as error:
                held = sum(
                    entries_held(choice.request, self._accepted.get(j))
                    for j, choice in enumerate(self.choices)
                    if j != k
                )
                raise ChoiceFailed(self.choices[k], error, held) from None
            if event is not None and event.HasField("accepted"):
                self._accepted[k] = event.accepted.prompt_tokens
            return event

        self._firsts = await all_or_cancel([first(k) for k in range(len(self._calls))])

    async def events(self) -> AsyncIterator[tuple[Choice, decoder_pb2.GenerateResponse]]:
        """Every event after `start`, with its choice, as they arrive; ChoiceFailed for the first
        call that fails."""
        for choice, first in zip(self.choices, self._firsts, strict=True):
            if first is not None:
                yield choice, first
        if len(self._calls) == 1:
            choice, events = self.choices[0], self._iterators[0]
            try:
                while self._firsts[0] is not None and (event := await anext(events, None)) is not None:
                    yield choice, event
            except grpc.aio.AioRpcError as error:
                raise ChoiceFailed(choice, error) from None
            return
        queue: asyncio.Queue[tuple[int, decoder_pb2.GenerateResponse | BaseException | None]]
        queue = asyncio.Queue(EVENTS_PER_CHOICE * len(self._calls))
        open_calls = [k for k, first in enumerate(self._firsts) if first is not None]
        self._readers = [asyncio.ensure_future(self._read(k, queue)) for k in open_calls]
        num_open = len(open_calls)
        while num_open:
            k, item = await queue.get()
            if item is None:
                num_open -= 1
            elif isinstance(item, grpc.aio.AioRpcError):
                raise ChoiceFailed(self.choices[k], item)
            elif isinstance(item, BaseException):
                raise item  # a bug in reading: a 500, as it would be from a lone call
            else:
                yield self.choices[k], item

    async def _read(
        self, k: int, queue: asyncio.Queue[tuple[int, decoder_pb2.GenerateResponse | BaseException | None]]
    ) -> None:
        """Call k's events into `queue`, then None, or the error that ended it."""
        try:
            while (event := await anext(self._iterators[k], None)) is not None:
                await queue.put((k, event))
        except Exception as error:
            await queue.put((k, error))
            return
        await queue.put((k, None))

    def close(self) -> None:
        """Cancels every call and reader: a no-op for the calls that ended, the rest freed at once."""
        for reader in self._readers:
            reader.cancel()
        for call in self._calls:
            call.cancel()
