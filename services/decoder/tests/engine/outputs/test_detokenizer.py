"""Incremental detokenization against the tokenizer's own one-shot decode, on real tokenizers.

Both tokenizers are built in the test with a deliberately small vocabulary, so most multi-byte
characters are split across several byte tokens.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from tandem.decoder.engine.outputs.detokenizer import (
    NUM_PROMPT_CONTEXT_TOKENS,
    IncrementalDetokenizer,
    find_stop,
    num_held_chars,
    prompt_context,
)

CORPUS = ["héllo wörld 你好 🙂", "hello world, hello again", "the quick brown fox says 你好"] * 20
EOS = "<|eos|>"
# Lone surrogates (Cs) are not encodable text; U+FFFD would look "broken".
TEXT = st.text(st.characters(exclude_characters="\ufffd", exclude_categories=("Cs",)), max_size=40)


def byte_level_bpe() -> Tokenizer:
    """GPT-2 / Qwen style: every byte is a token, so any text encodes and round-trips exactly."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    return tokenizer


def byte_fallback_bpe() -> Tokenizer:
    """Llama / sentencepiece style: "▁" marks spaces, characters outside the vocab become <0xNN>."""
    vocab = {"<unk>": 0, EOS: 1} | {f"<0x{b:02X}>": 2 + b for b in range(256)}
    for piece in ["▁", "h", "e", "l", "o", "w", "r", "d", "a", "b", "c", "▁h", "ll"]:
        vocab[piece] = len(vocab)
    merges = [("▁", "h"), ("l", "l")]
    tokenizer = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tokenizer.add_special_tokens([EOS])
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return tokenizer


BYTE_LEVEL = byte_level_bpe()
TOKENIZERS = {"byte_level": BYTE_LEVEL, "byte_fallback": byte_fallback_bpe()}


def stream(
    tokenizer: Tokenizer,
    token_ids: list[int],
    stop: tuple[str, ...] = (),
    include_stop: bool = False,
    chunk_size: int = 1,
    prompt_token_ids: list[int] | None = None,
    is_token_ids: list[bool] | None = None,  # all True when not given
) -> tuple[list[str], str | None]:
    """Feed ids `chunk_size` at a time, then flush unless a stop matched: (emitted chunks, matched stop)."""
    if prompt_token_ids is not None and is_token_ids is None:
        is_token_ids = [True] * len(prompt_token_ids)
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, is_token_ids, stop, include_stop)
    chunks = []
    for i in range(0, len(token_ids), chunk_size):
        step = detokenizer.add(token_ids[i : i + chunk_size])
        chunks.append(step.new_text)
        if step.matched_stop is not None:
            return chunks, step.matched_stop
    step = detokenizer.flush()
    return chunks + [step.new_text], step.matched_stop


def ids_of(*pieces: str) -> list[int]:
    """Encode each piece on its own, so a token boundary falls between consecutive pieces."""
    return [t for piece in pieces for t in BYTE_LEVEL.encode(piece).ids]


@pytest.mark.parametrize("name", TOKENIZERS)
@settings(max_examples=60, deadline=None)
@given(text=TEXT, chunk_size=st.integers(1, 3))
def test_emitted_text_concatenates_to_the_full_decode(name: str, text: str, chunk_size: int) -> None:
    tokenizer = TOKENIZERS[name]
    token_ids = tokenizer.encode(text).ids
    chunks, matched_stop = stream(tokenizer, token_ids, chunk_size=chunk_size)
    assert matched_stop is None
    assert "".join(chunks) == tokenizer.decode(token_ids)
    assert not any("\ufffd" in chunk for chunk in chunks)


@settings(max_examples=60, deadline=None)
@given(token_ids=st.lists(st.integers(0, BYTE_LEVEL.get_vocab_size() - 1), max_size=30))
def test_arbitrary_token_ids_concatenate_to_the_full_decode(token_ids: list[int]) -> None:
    chunks, _ = stream(BYTE_LEVEL, token_ids)
    assert "".join(chunks) == BYTE_LEVEL.decode(token_ids)


def test_emoji_split_across_byte_tokens_is_emitted_once_whole() -> None:
    token_ids = BYTE_LEVEL.encode("a🙂b").ids
    assert len(token_ids) >= 4  # "a", at least two tokens for the emoji's four bytes, "b"
    chunks, _ = stream(BYTE_LEVEL, token_ids)
    assert not any("\ufffd" in chunk for chunk in chunks)
    assert [c for c in chunks if c] == ["a", "🙂", "b"]


def test_prompt_gives_context_but_is_not_emitted() -> None:
    chunks, _ = stream(BYTE_LEVEL, ids_of(" again"), prompt_token_ids=ids_of("hello world,"))
    assert "".join(chunks) == " again"


def test_prompt_context_is_the_token_ids_after_the_last_embedding_position() -> None:
    # Embedding positions carry the placeholder ID 0.
    assert prompt_context([7, 8, 0, 0, 9, 10], [True, True, False, False, True, True]) == [9, 10]
    assert prompt_context([7, 8, 0], [True, True, False]) == []
    assert prompt_context([0, 0], [False, False]) == []
    assert prompt_context(list(range(1, 9)), [True] * 8) == list(range(9 - NUM_PROMPT_CONTEXT_TOKENS, 9))
    with pytest.raises(ValueError, match="is_token_ids has 2 entries for a prompt of 3"):
        prompt_context([1, 2, 3], [True, True])


@pytest.mark.parametrize("name", TOKENIZERS)
def test_a_prompt_ending_in_embeddings_gives_the_output_no_context(name: str) -> None:
    # Had the placeholder ID 0 been decoded as context (byte fallback's "<unk>"), sentencepiece would
    # keep the first output token's leading space: " hello world" instead of the plain decode.
    tokenizer = TOKENIZERS[name]
    output = tokenizer.encode("hello world").ids
    prompt = tokenizer.encode("abc").ids
    chunks, _ = stream(
        tokenizer, output, prompt_token_ids=prompt + [0, 0], is_token_ids=[True] * len(prompt) + [False] * 2
    )
    assert "".join(chunks) == tokenizer.decode(output)


@pytest.mark.parametrize("name", TOKENIZERS)
def test_the_tokens_after_the_last_embedding_are_the_whole_context(name: str) -> None:
    tokenizer = TOKENIZERS[name]
    output, after = tokenizer.encode("hello world").ids, tokenizer.encode("ab").ids
    mixed = [0] + after  # an embedding row, then tokens
    chunks, _ = stream(tokenizer, output, prompt_token_ids=mixed, is_token_ids=[False] + [True] * len(after))
    expected, _ = stream(tokenizer, output, prompt_token_ids=after)
    assert "".join(chunks) == "".join(expected)


def test_special_tokens_are_skipped_by_default() -> None:
    eos = BYTE_LEVEL.token_to_id(EOS)
    chunks, _ = stream(BYTE_LEVEL, ids_of("hi") + [eos])
    assert "".join(chunks) == "hi"
    detokenizer = IncrementalDetokenizer(BYTE_LEVEL, None, None, (), False, skip_special_tokens=False)
    assert detokenizer.add(ids_of("hi") + [eos]).new_text == "hi" + EOS


def test_stop_string_spanning_two_tokens_truncates_the_text() -> None:
    token_ids = ids_of("say ab", "cd tail")
    detokenizer = IncrementalDetokenizer(BYTE_LEVEL, None, None, ("bc",), include_stop=False)
    step = detokenizer.add(token_ids)
    assert (step.new_text, step.matched_stop) == ("say a", "bc")
    assert step.num_tokens == len(ids_of("say ab")) + 1  # the ids after the one completing "bc" are dropped
    with pytest.raises(RuntimeError):
        detokenizer.add(ids_of("x"))


def test_include_stop_keeps_the_matched_stop_string() -> None:
    chunks, matched_stop = stream(BYTE_LEVEL, ids_of("say ab", "cd tail"), ("bc",), include_stop=True)
    assert ("".join(chunks), matched_stop) == ("say abc", "bc")


def test_held_back_prefix_of_a_stop_is_released_by_flush() -> None:
    detokenizer = IncrementalDetokenizer(BYTE_LEVEL, None, None, ("abc",), include_stop=False)
    assert detokenizer.add(ids_of("say ", "ab")).new_text == "say "
    step = detokenizer.flush()
    assert (step.new_text, step.matched_stop) == ("ab", None)


def test_text_that_starts_a_stop_then_diverges_is_emitted() -> None:
    detokenizer = IncrementalDetokenizer(BYTE_LEVEL, None, None, ("abc",), include_stop=False)
    assert detokenizer.add(ids_of("ab")).new_text == ""
    step = detokenizer.add(ids_of("x"))
    assert (step.new_text, step.matched_stop) == ("abx", None)


def test_text_added_without_matching_stops_is_released_whole_and_never_matched_later() -> None:
    # Within min_new_tokens (as vLLM's min_tokens): a stop string there ends nothing, held back no text.
    detokenizer = IncrementalDetokenizer(BYTE_LEVEL, None, None, ("bc", "xy"), include_stop=False)
    step = detokenizer.add(ids_of("say abc x"), match_stops=False)
    assert (step.new_text, step.matched_stop) == ("say abc x", None)
    step = detokenizer.add(ids_of("y bc tail"))  # "xy" spans the two: only "bc" after it matches
    assert (step.new_text, step.matched_stop) == ("y ", "bc")


def test_multiple_stop_strings_pick_the_earliest_match() -> None:
    chunks, matched_stop = stream(BYTE_LEVEL, ids_of("hello world"), ("world", "lo"))
    assert ("".join(chunks), matched_stop) == ("hel", "lo")


def test_find_stop_prefers_the_match_that_ends_first_then_the_longest() -> None:
    assert find_stop("xabcd", ("abcd", "bc")) == (2, "bc")  # "bc" completes before "abcd" does
    assert find_stop("xabcd", ("cd", "abcd")) == (1, "abcd")  # same end: the longer one
    assert find_stop("xabcd", ("zz",)) is None


def test_num_held_chars_is_the_longest_tail_that_could_start_a_stop() -> None:
    assert num_held_chars("hello wor", ("world", "or")) == 3
    assert num_held_chars("hello", ("world",)) == 0
    assert num_held_chars("ab", ("ab",)) == 0  # a whole stop is a match, not something to hold


@settings(max_examples=80, deadline=None)
@given(
    text=st.text("abc 你🙂", max_size=30),
    stop=st.lists(st.text("abc 你🙂", min_size=1, max_size=3), max_size=3),
)
def test_stop_result_depends_on_the_text_not_on_token_boundaries(text: str, stop: list[str]) -> None:
    token_ids = BYTE_LEVEL.encode(text).ids
    chunks, matched_stop = stream(BYTE_LEVEL, token_ids, tuple(stop), include_stop=True)
    match = find_stop(text, stop)
    expected = text if match is None else text[: match[0] + len(match[1])]
    assert ("".join(chunks), matched_stop) == (expected, None if match is None else match[1])
