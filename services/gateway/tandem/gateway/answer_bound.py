"""The most bytes of JSON a non-streamed answer takes, counted from its decoded tokens as they come
(`Completion.add`): what the answer reserves among those the gateway holds (`answer_bytes`) just
before it is serialized.

NOTE: why an upper bound, not the JSON's size. The size is known only once the JSON is made, and the
reservation must come first (the answer waits when it does not fit). Each part is bounded by what was
decoded: a text is exactly its JSON string's characters (json.dumps escapes character by character,
so a choice's text is its deltas' texts' JSON together), in the choice's text and, with logprobs, each
token's and alternative's own text (`logprob_entries`; the completions shape's legacy spelling) as its
entry's token, chat's entry adding its "bytes" list (at most "255, " a byte); a token's entry is at
most `ENTRY_BYTES` apart from its text (spelled `token_id:N` with N of 10 digits, a logprob of
float32's longest repr, 23 characters) and each alternative at most `ALTERNATIVE_BYTES` (the
completions endpoint's older shape: `TEXT_ENTRY_BYTES`, `TEXT_ALTERNATIVE_BYTES`, its lists'
separators counted in each). From the real texts, so no text (a
long run of spaces, or a token forced again and again by logit_bias) passes it; the reservation is
settled to the real JSON once serialized. Prompt logprobs (`prompt_logprobs.py`) likewise: each
position at most `PROMPT_POSITION_BYTES`, each of its entries `PROMPT_ENTRY_BYTES` and its token's text,
counted once for each choice (or chat answer) that shows them.
"""

from __future__ import annotations

import asyncio
from json.encoder import encode_basestring_ascii  # json.dumps's own escaping of a string, in C

from tandem.client.pb.tandem.v1 import decoder_pb2
from tandem.gateway.logprob_entries import legacy_text, token_text

# {"token": "token_id:4294967295", "logprob": -1.0649640863824063e-32, "bytes": null, "top_logprobs": []}
# and its separator: a sampled token's chat entry, its text apart.
ENTRY_BYTES = 105
# {"token": "token_id:4294967295", "logprob": -1.0649640863824063e-32, "bytes": null} and its separator.
ALTERNATIVE_BYTES = 85
# "token_id:4294967295", in tokens, -1.0649640863824063e-32, in token_logprobs, {} in top_logprobs and
# 4294967295 in text_offset, each with its separator: a token's parts in the completions shape.
TEXT_ENTRY_BYTES = 23 + 25 + 4 + 12
TEXT_ALTERNATIVE_BYTES = 48  # "token_id:4294967295": -1.0649640863824063e-32, in its token's object
BYTE_LIST_BYTES = 5  # "255, ": one byte in an entry's "bytes" list, at most
# A token spelled by its bytes has no "token_id:4294967295" in its entry: its text's JSON stands there.
SPELLED_SAVING = len("token_id:4294967295")
# A choice's keys, index, finish reason and quotes around its text and logprobs lists, and its separator.
CHOICE_FRAME_BYTES = 256
# "4294967295": {"logprob": -1.0649640863824063e-32, "rank": null, "decoded_token": null} and its
# separator: a prompt position's entry, its token's text apart (the text's quotes fit in null's place).
PROMPT_ENTRY_BYTES = 89
PROMPT_POSITION_BYTES = 6  # {} or null, and its separator
# , "prompt_logprobs": [] (a choice's last key, or a chat answer's own).
PROMPT_FRAME_BYTES = 24
# Between two texts counted together (`_num_joined_escaped`): ASCII, so no character spans it; \u0000.
SEPARATOR = b"\x00"
SEPARATOR_JSON_CHARS = 6
# Prompt positions counted between two yields of the event loop (`prompt_bound`): about 2 ms of 21 entries.
SLICE_POSITIONS = 512


def delta_bound(delta: decoder_pb2.TokenDelta, kind: str, with_logprobs: bool) -> int:
    """The most bytes `delta` adds to its choice's JSON (`kind`: "chat" or "text")."""
    text = delta.text
    num_escaped = _num_escaped(text)
    num_bytes = num_escaped  # the choice's text (message.content, or text)
    if with_logprobs:  # each token's entry and alternatives
        num_alternatives = sum(len(top.token_ids) for top in delta.top_logprobs)
        if kind == "chat":
            num_bytes += ENTRY_BYTES * len(delta.token_ids) + ALTERNATIVE_BYTES * num_alternatives
        else:  # each token's top_logprobs holds the token too (`text_logprobs`): one more alternative
            num_alternatives += len(delta.token_ids)
            num_bytes += TEXT_ENTRY_BYTES * len(delta.token_ids) + TEXT_ALTERNATIVE_BYTES * num_alternatives
        # Each spelled token's text (and in chat its "bytes" list) on top of its entry; an older
        # decoder's delta spells its first token with the delta's text and the rest by ID.
        # The completions shape spells a token that is part of a character `bytes:\\xNN...`.
        per_byte = BYTE_LIST_BYTES if kind == "chat" else 0
        spell = token_text if kind == "chat" else legacy_text
        # Bytes are a token's spelling only where there is one for each (`chat_logprobs`'s is_spelled):
        # counted otherwise, a delta of 2 tokens and 1 byte string took the saving of a spelled token
        # and not its text (50 such deltas: chat bound 153,856 bytes, its JSON 244,376).
        is_spelled = len(delta.token_bytes) == len(delta.token_ids)
        num_copies = 1 if kind == "chat" else 2  # a token's text in its entry (and its top_logprobs' key)
        spelled = [
            *list(delta.token_bytes if is_spelled else ()) * num_copies,
            *(
                own
                for top in delta.top_logprobs
                if len(top.token_bytes) == len(top.token_ids)
                for own in top.token_bytes
            ),
        ]
        num_bytes += sum(_num_escaped(spell(own)) + per_byte * len(own) for own in spelled)
        num_bytes -= SPELLED_SAVING * len(spelled)
        if not is_spelled:
            num_bytes += (num_escaped + per_byte * len(text.encode())) * num_copies
    return num_bytes


def _num_escaped(text: str) -> int:
    """Characters of `text`'s JSON string, its quotes apart."""
    return len(encode_basestring_ascii(text)) - 2 if text else 0


async def prompt_bound(delta: decoder_pb2.TokenDelta) -> int:
    """The most bytes `delta`'s prompt logprobs take in an answer (`prompt_logprobs.prompt_entries`),
    counted SLICE_POSITIONS positions at a time with the event loop let go between slices: 8,192
    positions of 21 entries are 172,000 texts to read out of the delta, 18 ms, and to count, 11 ms."""
    positions = delta.prompt_logprobs
    num_bytes = PROMPT_FRAME_BYTES
    for lo in range(0, len(positions), SLICE_POSITIONS):
        num_bytes += _slice_bound(positions[lo : lo + SLICE_POSITIONS])
        await asyncio.sleep(0)
    return num_bytes


def _slice_bound(positions: list[decoder_pb2.PromptLogprob]) -> int:
    num_entries = 0
    # Every token's bytes: its decoded_token, or counted though shown as null (an older decoder's
    # alternatives without a byte string each; the prompt's token without any): more, never less.
    texts: list[bytes] = []
    for position in positions:
        top = position.top_logprobs
        num_entries += len(top.token_ids) + position.HasField("token_id")
        texts += top.token_bytes
        texts.append(position.token_bytes)
    num_bytes = PROMPT_POSITION_BYTES * len(positions) + PROMPT_ENTRY_BYTES * num_entries
    return num_bytes + _num_joined_escaped(texts)


def _num_joined_escaped(texts: list[bytes]) -> int:
    """Characters of the JSON strings of `texts` each decoded as `token_text` decodes it, all together.

    NOTE: why joined. Decoded and escaped one at a time, 8,192 positions of 21 entries were 172,000
    calls: 74-140 ms on the event loop, a neighbour's stream held for up to 296 ms. Joined with NUL
    between them they are one decode and one escape in C, 11 ms for them all, and still exact: UTF-8's
    decoder never takes an ASCII byte into a character or into the invalid run one U+FFFD replaces,
    so no text's bytes meet their neighbour's across a NUL, and each NUL is `\\u0000`, 6 characters,
    taken off again (a NUL within a text is that text's own and stays counted). A bound of 6
    characters a byte (a control byte's `\\u0001`, an invalid byte's `\\ufffd`: the answer is ASCII)
    would need the same bytes read out of the delta, most of the time left, for up to 6 times the JSON.
    """
    if not texts:
        return 0
    joined = SEPARATOR.join(texts).decode("utf-8", errors="replace")
    return len(encode_basestring_ascii(joined)) - 2 - SEPARATOR_JSON_CHARS * (len(texts) - 1)
