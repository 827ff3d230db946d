"""Logprobs entries from a TokenDelta: each token and alternative spelled by its own bytes, however many
tokens a delta carries (a reader behind gets merged deltas; speculation verifies several a step)."""

from __future__ import annotations

from tandem.client.pb.tandem.v1 import decoder_pb2
from tandem.gateway.logprob_entries import TextOffsets, chat_logprobs, logprob, text_logprobs
from tandem.gateway.responses import Completion

SMILE = "🙂".encode()  # 4 bytes: split over two tokens below


def _delta(parts: list[bytes], first_id: int = 10) -> decoder_pb2.TokenDelta:
    """One delta of `parts`' tokens, each with one alternative (token ID 99, spelled "x")."""
    delta = decoder_pb2.TokenDelta(
        token_ids=range(first_id, first_id + len(parts)),
        text=b"".join(parts).decode(errors="ignore"),
        logprobs=[-0.5] * len(parts),
        token_bytes=parts,
    )
    for _ in parts:
        delta.top_logprobs.add(token_ids=[99], logprobs=[-3.0], token_bytes=[b"x"])
    return delta


def test_each_token_of_a_merged_delta_gets_its_own_text_and_bytes() -> None:
    entries = chat_logprobs(_delta([b"Once", b" upon", b" a"]))
    assert [e["token"] for e in entries] == ["Once", " upon", " a"]
    assert [e["bytes"] for e in entries] == [list(b"Once"), list(b" upon"), list(b" a")]
    assert all(e["top_logprobs"] == [{"token": "x", "logprob": -3.0, "bytes": [120]}] for e in entries)


def test_entries_are_the_same_however_the_tokens_are_grouped_into_deltas() -> None:
    parts = [b"Once", b" upon", SMILE[:2], SMILE[2:], b" a"]
    one_by_one = [e for k, part in enumerate(parts) for e in chat_logprobs(_delta([part], 10 + k))]
    assert chat_logprobs(_delta(parts)) == one_by_one


def test_part_of_a_character_is_its_raw_bytes_and_replacement_text() -> None:
    first, second = chat_logprobs(_delta([SMILE[:2], SMILE[2:]]))
    assert (first["token"], second["token"]) == ("\ufffd", "\ufffd\ufffd")  # as vLLM's text for it
    assert bytes(first["bytes"] + second["bytes"]) == SMILE  # as OpenAI's: the client joins them


def test_completions_tokens_and_offsets_are_per_token_and_a_split_character_counts_once() -> None:
    entries = chat_logprobs(_delta([b"Once", SMILE[:2], SMILE[2:], b" a"]))
    logprobs = text_logprobs(entries, TextOffsets())
    # OpenAI's legacy spelling of bytes that are no text on their own
    assert logprobs["tokens"] == ["Once", "bytes:\\xf0\\x9f", "bytes:\\x99\\x82", " a"]
    assert logprobs["top_logprobs"] == [{token: -0.5, "x": -3.0} for token in logprobs["tokens"]]
    # Offsets into the completion's text "Once🙂 a": the smile is one character, where it ends.
    assert logprobs["text_offset"] == [0, 4, 4, 5]


def test_completions_alternatives_that_are_parts_of_characters_keep_a_key_each() -> None:
    delta = _delta([SMILE[:2]])
    del delta.top_logprobs[:]
    alternatives = ["我".encode()[:2], "你".encode()[:2], "我".encode()[:2], b"ok", b"ok"]
    delta.top_logprobs.add(
        token_ids=range(5), logprobs=[-1.0, -2.0, -3.0, -4.0, -5.0], token_bytes=alternatives
    )
    (keyed,) = text_logprobs(chat_logprobs(delta), TextOffsets())["top_logprobs"]
    # Spelled alike still (two tokenizer entries of the same bytes): the first, the likelier, stays.
    assert keyed == {"bytes:\\xf0\\x9f": -0.5, "bytes:\\xe6\\x88": -1.0, "bytes:\\xe4\\xbd": -2.0, "ok": -4.0}


def test_completions_top_logprobs_hold_the_sampled_token_first_as_vllms_do() -> None:
    # `logprobs: 2`. Sampled below the two likeliest (temperature): 3 keys, it first. Sampled among
    # them: 2 keys, its value the decoder's logprob for the sampled token. It was left out: 2 and 2.
    unlikely, likely = _delta([b" cat"]), _delta([b" the"])
    for delta in (unlikely, likely):
        del delta.top_logprobs[:]
        delta.top_logprobs.add(token_ids=[7, 8], logprobs=[-0.25, -1.0], token_bytes=[b" the", b" a"])
    unlikely.logprobs[0], likely.logprobs[0] = -4.0, -0.25
    (sampled_below,) = text_logprobs(chat_logprobs(unlikely), TextOffsets())["top_logprobs"]
    (sampled_among,) = text_logprobs(chat_logprobs(likely), TextOffsets())["top_logprobs"]
    assert list(sampled_below.items()) == [(" cat", -4.0), (" the", -0.25), (" a", -1.0)]
    assert list(sampled_among.items()) == [(" the", -0.25), (" a", -1.0)]
    # Chat's top_logprobs are the alternatives alone, as OpenAI's and vLLM's chat give them.
    assert [a["token"] for a in chat_logprobs(unlikely)[0]["top_logprobs"]] == [" the", " a"]


def test_chat_spells_parts_of_characters_as_replacement_text_with_their_bytes() -> None:
    (entry,) = chat_logprobs(_delta([SMILE[:2]]))
    assert (entry["token"], entry["bytes"]) == ("\ufffd", list(SMILE[:2]))


def test_offsets_index_the_text_when_the_detokenizer_dropped_the_first_tokens_space() -> None:
    # SentencePiece after a control token: tokens b" Hello" b" world", text "Hello world".
    for text, expected in (("Hello world", [0, 5, 11]), (" Hello world", [0, 6, 12])):
        delta = _delta([b" Hello", b" world", b"!"])
        delta.text = text + "!"
        streamed, whole = Completion("text", "abc", "tiny"), Completion("text", "abc", "tiny")
        assert streamed.chunk(delta, True)["choices"][0]["logprobs"]["text_offset"] == expected
        whole.add(delta, True)
        logprobs = whole.choice(True)["logprobs"]
        assert logprobs["text_offset"] == expected
        ends = [*expected[1:], len(delta.text)]
        pieces = [delta.text[o:end] for o, end in zip(expected, ends, strict=True)]
        assert pieces == [text.removesuffix(" world"), " world", "!"]
        assert logprobs["tokens"] == [" Hello", " world", "!"]  # each token's own bytes still


def test_streamed_and_whole_completions_give_the_same_offsets() -> None:
    deltas = [_delta([b"Once", SMILE[:2]]), _delta([SMILE[2:], b" a"], 12), _delta([b" b"], 14)]
    streamed, whole = Completion("text", "abc", "tiny"), Completion("text", "abc", "tiny")
    offsets = []
    for delta in deltas:
        offsets += streamed.chunk(delta, True)["choices"][0]["logprobs"]["text_offset"]
        whole.add(delta, True)
    assert offsets == whole.choice(True)["logprobs"]["text_offset"] == [0, 4, 4, 5, 7]


def test_a_stream_holds_entries_back_until_the_text_they_index_starts() -> None:
    # A stop string's prefix held back: the first chunk has b" Hello" and no text yet. Streamed, its
    # space was counted (text_offset [0, 6]), though the text "Hello world" dropped it.
    first, second = _delta([b" Hello"]), _delta([b" world"], 11)
    first.text, second.text = "", "Hello world"
    streamed, whole = Completion("text", "abc", "tiny"), Completion("text", "abc", "tiny")
    chunks = [streamed.chunk(first, True), streamed.chunk(second, True), streamed.chunk(None, True)]
    lists = [chunk["choices"][0]["logprobs"] for chunk in chunks]
    assert (lists[0]["tokens"], lists[1]["tokens"], lists[2]) == ([], [" Hello", " world"], None)
    for delta in (first, second):
        whole.add(delta, True)
    assert lists[1]["text_offset"] == whole.choice(True)["logprobs"]["text_offset"] == [0, 5]


def test_a_stream_with_no_text_sends_its_held_entries_with_the_closing_chunk() -> None:
    streamed = Completion("text", "abc", "tiny")
    delta = _delta([b" Hello"])
    delta.text = ""
    assert streamed.chunk(delta, True)["choices"][0]["logprobs"]["tokens"] == []
    closing = streamed.chunk(None, True)["choices"][0]["logprobs"]
    assert (closing["tokens"], closing["text_offset"]) == ([" Hello"], [0])


def test_an_older_decoders_delta_without_bytes_is_spelled_by_id_past_its_first_token() -> None:
    delta = decoder_pb2.TokenDelta(token_ids=[5, 6], text="ab", logprobs=[-1.0, -1.0])
    delta.top_logprobs.add(token_ids=[7], logprobs=[-2.0])
    first, second = chat_logprobs(delta)
    assert (first["token"], first["bytes"]) == ("ab", [97, 98])
    assert (second["token"], second["bytes"]) == ("token_id:6", None)
    assert first["top_logprobs"] == [{"token": "token_id:7", "logprob": -2.0, "bytes": None}]


def test_only_minus_infinity_is_clamped_as_vllms_clamp_does() -> None:
    # A token ruled out: JSON has no -Infinity. A finite logprob below -9999 is the model's: kept.
    assert logprob(float("-inf")) == -9999.0
    assert [logprob(v) for v in (-12000.0, -1e30, -9999.0, -0.5, 0.0)] == [
        -12000.0,
        -1e30,
        -9999.0,
        -0.5,
        0.0,
    ]
    delta = decoder_pb2.TokenDelta(token_ids=[1], logprobs=[-12000.0], token_bytes=[b"a"])
    delta.top_logprobs.add(token_ids=[2], logprobs=[float("-inf")], token_bytes=[b"b"])
    (entry,) = chat_logprobs(delta)
    assert entry["logprob"] == -12000.0 and entry["top_logprobs"][0]["logprob"] == -9999.0
