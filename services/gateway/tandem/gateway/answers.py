"""A completion request's answer from its choices' events: one OpenAI object (`collect`, then
`write`, which serializes it a slice of a choice at a time), or server-sent events as they come (`stream`).

A stream carries each choice's chunks with its index, interleaved as the choices advance: chat opens
with each choice's role chunk, a choice's closing chunk (its finish_reason) follows its last token at
once, the usage of every choice comes last (stream_options.include_usage), then `[DONE]`, once. An
error after the stream began (a choice failed: its neighbours are cancelled) is one `data: {"error":
...}` event before `[DONE]`.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

from aiohttp import web

from tandem.gateway.answer_bytes import AnswerBytes
from tandem.gateway.calls import GenerateCall
from tandem.gateway.choice_json import choice_json
from tandem.gateway.choice_streams import ChoiceFailed, ChoiceStreams
from tandem.gateway.errors import HttpError
from tandem.gateway.prompt_logprobs import prompt_json
from tandem.gateway.responses import Completion, answer_frame, share_scores, usage_chunk

# FINISH_REASON_ABORTED: the decoder drained (SIGTERM) before the answer ended; OpenAI has no such reason.
ABORTED = HttpError(503, "service_unavailable", "the server stopped before the answer ended; retry")


async def collect(streams: ChoiceStreams, completions: list[Completion], with_logprobs: bool) -> None:
    """Every choice's events into its Completion (`completions`, in index order); ChoiceFailed for the
    first choice that fails."""
    async with contextlib.aclosing(streams.events()) as events:
        async for choice, event in events:
            completion = completions[choice.index]
            if event.HasField("delta"):
                completion.add(event.delta, with_logprobs)
                if event.delta.prompt_logprobs:  # the first delta's: counted letting the loop go
                    await completion.bound_scores(event.delta)
            elif event.HasField("finished"):
                completion.finished = event.finished


async def write(
    request: web.Request,
    completions: list[Completion],
    with_logprobs: bool,
    held: AnswerBytes,
    caller: str,
    timeout_s: float,
) -> web.StreamResponse:
    """The non-streamed answer (`responses.answer`'s JSON), each choice rendered and serialized a slice
    at a time with the event loop let go between slices (`choice_json`), then sent with its length.
    Rendered whole, 16 choices of 8,192 tokens with 20 alternatives each made 816 MB of Python objects
    and a 191 MiB JSON dump that held the loop, every other caller's stream and /health, for 4 s; a
    choice at a time, one choice of 8,192 tokens still held it for 1 s.

    Its length comes first, so every choice's JSON is held before the first byte goes: that answer's
    peak is its 191 MiB of JSON, its 31 MiB of serialized deltas and one slice's objects being
    rendered. Before any of it is made, the answer reserves its JSON's most bytes among those `held`
    for `caller` (`Completion.json_bound`, from its decoded tokens), waiting up to `timeout_s` while
    they do not fit (`AnswerBytes.reserve`); once serialized the reservation is settled to the real
    JSON, and given back, in this one finally, when the answer is written, fails or its connection
    ends (the handler is cancelled)."""
    share_scores(completions)
    before, after = (part.encode() for part in answer_frame(completions, with_scores=False))
    separator = b", "
    frame = len(before) + len(separator) * (len(completions) - 1) + len(after)
    bound = frame + sum(completion.json_bound for completion in completions)
    reservation = await held.reserve(caller, bound, timeout_s)
    try:
        choices = [
            await choice_json(completion, with_logprobs, reservation.hold) for completion in completions
        ]
        reservation.hold(frame)
        # A chat answer's prompt logprobs: its last key, a slice of positions at a time.
        scored = completions[0].scored if completions[0].kind == "chat" else None
        tail = [after]
        if scored is not None:
            opening = b', "prompt_logprobs": '
            reservation.hold(len(opening))
            tail = [after[:-1], opening, *await prompt_json(scored, reservation.hold), b"}"]
        reservation.settle()
        response = web.StreamResponse(headers={"Content-Type": "application/json; charset=utf-8"})
        num_bytes = sum(len(piece) for pieces in (*choices, tail) for piece in pieces)
        response.content_length = frame - len(after) + num_bytes
        await response.prepare(request)
        await response.write(before)
        for i, pieces in enumerate(choices):
            if i:
                await response.write(separator)
            for piece in pieces:
                await response.write(piece)
        for piece in tail:
            await response.write(piece)
        await response.write_eof()
        return response
    finally:
        reservation.release()


async def stream(
    request: web.Request,
    call: GenerateCall,
    streams: ChoiceStreams,
    completions: list[Completion],
    with_logprobs: bool,
) -> web.StreamResponse:
    """The choices' events as server-sent events, once every choice was accepted (`streams.start`)."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)

    async def send(payload: dict[str, Any] | str) -> None:
        text = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
        await response.write(f"data: {text}\n\n".encode())

    if completions[0].kind == "chat":
        for completion in completions:
            await send(completion.opening_chunk())
    try:
        async with contextlib.aclosing(streams.events()) as events:
            async for choice, event in events:
                completion = completions[choice.index]
                if event.HasField("delta") and with_logprobs:
                    await send(completion.chunk(event.delta, with_logprobs))
                elif event.HasField("delta") and event.delta.text:
                    await send(completion.text_chunk(event.delta.text))
                elif event.HasField("finished"):
                    completion.finished = event.finished
                    if completion.aborted:
                        await send(ABORTED.body())
                        break
                    await send(completion.chunk(None, with_logprobs))
            else:
                if call.include_usage and all(c.finished is not None for c in completions):
                    await send(usage_chunk(completions))
    except ChoiceFailed as failed:  # after the headers: the error goes in the stream
        await send(failed.http_error(call.names, call.is_batch).body())
    await send("[DONE]")
    await response.write_eof()
    return response
