"""One choice of a non-streamed answer as JSON, the bytes `json.dumps(completion.choice(...))` makes,
rendered and serialized a slice of its logprobs at a time with the event loop let go between slices.

NOTE: why slices on the loop, not a worker thread. A choice of 8,192 tokens with 20 alternatives is
12 MiB of JSON from 172,000 logprob values; rendered and dumped in one go it held the loop (every other
caller's stream, /health) for 1 s on a 2-core machine, 4.3 s for 32,768 tokens. json.dumps's C encoder
holds the GIL for a whole call, so a thread dumping the choice still held the loop for as long as the
dump took, and the rendering is Python either way: a thread would add threads and copies, not spare
work. A slice of `SLICE_VALUES` values costs a few ms, after which everything else waiting runs.

The bytes are the same: a list dumped in slices is its slices' items (each slice's dump without its
brackets) joined by ", ", json.dumps's own separator; the rest of the choice is dumped whole around its
logprobs lists (the last key of a choice, so a text holding the marker cannot be mistaken for it), but
for a completions choice's prompt logprobs, which come after them, a slice of positions at a time
(`prompt_logprobs.prompt_json`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from tandem.client.pb.tandem.v1 import decoder_pb2
from tandem.gateway.logprob_entries import TextOffsets, chat_logprobs, text_logprobs
from tandem.gateway.prompt_logprobs import prompt_json
from tandem.gateway.responses import Completion

# Logprob values (a token's own and each of its alternatives') rendered and dumped between two yields:
# about 6 ms of the loop at 6 us a value; a yield costs about 10 us.
SLICE_VALUES = 1024
MARKER = "\x00tandem-logprobs\x00"
LISTS = {
    "chat": ("content",),  # {"content": [entry, ...]}
    "text": ("tokens", "token_logprobs", "top_logprobs", "text_offset"),  # `text_logprobs`, list by list
}


async def choice_json(
    completion: Completion, with_logprobs: bool, on_piece: Callable[[int], None] | None = None
) -> list[bytes]:
    """`completion`'s choice as JSON, in pieces whose concatenation is json.dumps(choice).encode();
    `on_piece(num_bytes)` is told of each piece as it is made (the gateway counts the bytes it holds)."""
    pieces: list[bytes] = []

    def tell(num_bytes: int) -> None:
        if on_piece is not None:
            on_piece(num_bytes)

    def counted(piece: bytes) -> bytes:
        tell(len(piece))
        return piece

    scored = completion.scored if completion.kind == "text" else None  # chat's are the answer's
    if not with_logprobs:  # its text alone: one dump, at most a few hundred KiB
        piece = counted(json.dumps(completion.choice(False, with_scores=False)).encode())
        # Let go after it all the same: 16 choices of 131,072 CJK characters each are 76 ms of dumps.
        await asyncio.sleep(0)
        return [piece] if scored is None else await _scored([piece], scored, tell)
    dumped = json.dumps(completion.choice(False, with_scores=False) | {"logprobs": MARKER})
    before, after = dumped.rsplit(json.dumps(MARKER), 1)
    names = LISTS[completion.kind]
    frame = json.dumps(dict.fromkeys(names, MARKER)).split(json.dumps(MARKER))  # one part more than lists
    items: dict[str, list[bytes]] = {name: [] for name in names}  # each list's slices, dumped
    offsets = TextOffsets()  # carried from slice to slice (text_offset)
    offsets.see("".join(completion.text))
    async for entries in _slices(completion.deltas):
        lists = {"content": entries} if completion.kind == "chat" else text_logprobs(entries, offsets)
        for name in names:
            if lists[name]:
                items[name].append(counted(json.dumps(lists[name])[1:-1].encode()))
        await asyncio.sleep(0)
    pieces.append(counted(before.encode()))
    for name, part in zip(names, frame, strict=False):
        pieces.append(counted((part + "[").encode()))
        for i, piece in enumerate(items[name]):
            if i:
                pieces.append(counted(b", "))
            pieces.append(piece)
        pieces.append(counted(b"]"))
    pieces.append(counted((frame[-1] + after).encode()))
    return pieces if scored is None else await _scored(pieces, scored, tell)


async def _scored(pieces: list[bytes], scored: bytes, on_piece: Callable[[int], None]) -> list[bytes]:
    """A choice's `pieces` (its JSON, told of already) with its prompt logprobs as its last key."""
    pieces[-1] = pieces[-1].removesuffix(b"}")
    opening = b', "prompt_logprobs": '
    on_piece(len(opening))  # the closing brace, told of already, moves after them
    return [*pieces, opening, *await prompt_json(scored, on_piece), b"}"]


async def _slices(deltas: list[bytes]) -> AsyncIterator[list[dict[str, Any]]]:
    """OpenAI's logprobs entries of `deltas` (serialized TokenDeltas), about SLICE_VALUES values at a time."""
    entries: list[dict[str, Any]] = []
    num_values = 0
    for data in deltas:
        delta = decoder_pb2.TokenDelta.FromString(data)
        entries.extend(chat_logprobs(delta))
        num_values += len(delta.token_ids) + sum(len(top.token_ids) for top in delta.top_logprobs)
        if num_values >= SLICE_VALUES:
            yield entries
            entries, num_values = [], 0
    if entries:
        yield entries
