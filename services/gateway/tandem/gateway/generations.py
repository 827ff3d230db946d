"""A completion request's choices generated, each a Generate stream on its caller's connection, within
the bounds the gateway keeps per caller: its open streams (--max-streams-per-caller), the choices of its
non-streamed answers being written (as many again), and the services' max_message_bytes for the calls;
then answered, streamed or written whole (`answers.py`).
"""

from __future__ import annotations

import time
import uuid
from collections import Counter

from aiohttp import web

from tandem.gateway import answers
from tandem.gateway.answer_bytes import AnswerBytes
from tandem.gateway.body_intake import LARGE_BODY
from tandem.gateway.callers import CallerChannels
from tandem.gateway.calls import GenerateCall
from tandem.gateway.choice_streams import ChoiceFailed, ChoiceStreams
from tandem.gateway.choices import choices_of
from tandem.gateway.config import GatewayConfig
from tandem.gateway.encoder_info import Metadata
from tandem.gateway.errors import HttpError, Refused
from tandem.gateway.refusals import error_response
from tandem.gateway.responses import Completion


class Generations:
    """The gateway's completions in flight, counted per caller: open streams and answers being written."""

    def __init__(self, config: GatewayConfig, callers: CallerChannels, answer_bytes: AnswerBytes) -> None:
        self.config = config
        self.callers = callers
        self.answer_bytes = answer_bytes  # the answers' JSON held, reserved once decoded
        self._streams: Counter[str] = Counter()  # open completions per caller
        self._writing: Counter[str] = Counter()  # choices of non-streamed answers being written, per caller

    async def complete(
        self, request: web.Request, call: GenerateCall, kind: str, caller: str, model: str, metadata: Metadata
    ) -> web.StreamResponse:
        """`call`'s choices generated for `caller` and answered as `model`'s, or a 429 or 413 where a
        bound refuses them, before any call is made."""
        # Each choice is a Generate stream on the caller's connection, as the decoder counts them.
        num_choices = call.num_choices
        if self._streams[caller] + num_choices > self.config.max_streams_per_caller:
            limit = self.config.max_streams_per_caller
            message = (
                f"{self._streams[caller]} completion streams of this caller are open and this request "
                f"asks {num_choices} more, over {limit} (--max-streams-per-caller; a stream a choice)"
            )
            return error_response(HttpError(429, "rate_limit_error", message, retry_after_s=1.0))
        if (unread := self._unread_answers(caller, num_choices)) is not None:
            return error_response(unread)
        if (too_large := self._too_large(call, kind)) is not None:
            return error_response(too_large)
        return await self._generate(request, call, kind, caller, model, metadata)

    async def _generate(
        self,
        request: web.Request,
        call: GenerateCall,
        kind: str,
        caller: str,
        model: str,
        metadata: Metadata,
    ) -> web.StreamResponse:
        """`call`'s choices generated and answered, streamed or written whole."""
        num_choices = call.num_choices
        request_id = uuid.uuid4().hex
        choices = choices_of(call, request_id)
        with_logprobs = call.requests[0].output.logprobs
        created = int(time.time())
        completions = [Completion(kind, request_id, model, c.index, c.prompt_index, created) for c in choices]
        self._streams[caller] += num_choices
        try:
            async with self.callers.stub(caller) as stub:
                streams = ChoiceStreams(stub, choices, metadata)
                try:
                    try:
                        await streams.start()  # a refusal arrives here, before any byte is written
                    except ChoiceFailed as failed:
                        raise Refused(failed.http_error(call.names, call.is_batch)) from None
                    if (held := request.get(LARGE_BODY)) is not None:
                        held.release()  # the requests went out: their bytes are the decoder's now
                    if call.is_stream:
                        return await answers.stream(request, call, streams, completions, with_logprobs)
                    try:
                        await answers.collect(streams, completions, with_logprobs)
                    except ChoiceFailed as failed:
                        raise Refused(failed.http_error(call.names, call.is_batch)) from None
                    if any(c.aborted for c in completions):
                        return error_response(answers.ABORTED)
                finally:
                    streams.close()  # no-ops for calls that ended; frees the rest (a failure, a caller gone)
        finally:
            self._streams[caller] -= num_choices
            if not self._streams[caller]:
                del self._streams[caller]
        # Written once its streams are given back: its choices ended, and a caller reading it slowly (or
        # not at all, until --write-timeout-s) held its places and its channel meanwhile, its next
        # request refused 429 "streams are open" though the decoder had none of its. Its choices count
        # among the caller's answers being written instead, in the same step (no await between), until
        # it is written or its connection ends (--write-timeout-s, a reset: the handler is cancelled).
        # Its JSON's bytes are reserved there, once decoded (`answer_bytes`): it may wait for them.
        self._writing[caller] += num_choices
        try:
            held, timeout_s = self.answer_bytes, self.config.write_timeout_s
            return await answers.write(request, completions, with_logprobs, held, caller, timeout_s)
        finally:
            self._writing[caller] -= num_choices
            if not self._writing[caller]:
                del self._writing[caller]

    def _unread_answers(self, caller: str, num_choices: int) -> HttpError | None:
        """A 429 when `caller`'s open streams, its answers being written and `num_choices` more are over
        twice --max-streams-per-caller, in choices.

        NOTE: why a second bound, and why twice. An answer is written after its streams are given back
        (a slow reader holds no decoder places), so the streams bound alone no longer bounds the answers
        a caller leaves unread: one that never read held up to --max-connections of them, each until
        --write-timeout-s, and one answer can be 191 MiB of JSON (`answers.write`). Counted in choices,
        not answers, as an answer's size grows with its choices. Twice, so a caller may have as many
        choices being written as it may have streams open: its next request starts while the last is
        still being read, as a client reading an answer while it asks the next one does. An answer's
        choices go from streams to being written in one step, so a caller holds at most twice the
        flag's choices at any time, twice what it held when its answers were written within its streams."""
        limit = self.config.max_streams_per_caller
        writing, open_ = self._writing[caller], self._streams[caller]
        if open_ + writing + num_choices <= 2 * limit:
            return None
        message = (
            f"{writing} choices of this caller's answers are being written, unread, with {open_} completion "
            f"streams open, and this request asks {num_choices} more, over {2 * limit} (twice "
            f"--max-streams-per-caller: as many choices may wait to be read as streams may be open)"
        )
        return HttpError(429, "rate_limit_error", message, retry_after_s=1.0)

    def _too_large(self, call: GenerateCall, kind: str) -> HttpError | None:
        """A 413 when a Generate call of `call` is over the services' max_message_bytes, or all of
        them together are: n choices of a prompt of embedding rows are n times its bytes, held by the
        gateway as they go out. Reckoned before any copy is made."""
        limit = self.config.max_message_bytes
        sizes = [generate.ByteSize() for generate in call.requests]
        field = "messages" if kind == "chat" else "prompt"  # what makes a request this large
        for i, size in enumerate(sizes):
            if size > limit:
                where = f"prompt[{i}]" if call.is_batch else field
                message = (
                    f"{where}: the request is {size} bytes as a Generate call, over the services' "
                    f"max_message_bytes {limit}"
                )
                return HttpError(413, "invalid_request_error", message, where)
        if sum(sizes) * call.n > limit:
            where = "n" if call.n > 1 else field
            message = (
                f"{where}: the request's {call.num_choices} Generate calls are {sum(sizes) * call.n} bytes "
                f"together, over the services' max_message_bytes {limit}"
            )
            return HttpError(413, "invalid_request_error", message, where)
        return None
