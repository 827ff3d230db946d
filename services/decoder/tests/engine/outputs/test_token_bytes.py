"""Each token's own bytes (logprobs' `bytes`), against the tokenizer's own decode of real tokenizers: the
two styles of test_detokenizer (byte-level BPE; SentencePiece's "▁" and byte fallback), small enough that
most multi-byte characters are split across tokens."""

from __future__ import annotations

import pytest
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from tandem.decoder.engine.outputs.token_bytes import token_bytes_table

from .test_detokenizer import BYTE_LEVEL, EOS, TOKENIZERS

TEXTS = ["hello world, hello again", "héllo wörld 你好 🙂", "the quick\nbrown fox\t"]


@pytest.mark.parametrize("style", TOKENIZERS)
@pytest.mark.parametrize("text", TEXTS)
def test_a_texts_tokens_bytes_join_to_the_texts_utf8(style: str, text: str) -> None:
    tokenizer = TOKENIZERS[style]
    table = token_bytes_table(tokenizer)
    ids = tokenizer.encode(text).ids
    joined = b"".join(table.of(ids))
    # SentencePiece's prefix space is the first token's own: its decode strips it from the whole text.
    assert joined.decode() == (" " + text if style == "byte_fallback" else text)


@pytest.mark.parametrize("style", TOKENIZERS)
def test_a_token_that_is_one_character_decodes_to_its_bytes(style: str) -> None:
    tokenizer = TOKENIZERS[style]
    table = token_bytes_table(tokenizer)
    for token_id, own in enumerate(table.table):
        try:
            text = own.decode()
        except UnicodeDecodeError:  # part of a character: no decode of it alone could say which bytes
            continue
        if not text.startswith(" "):  # the Strip decoder drops a leading space from a whole text
            assert tokenizer.decode([token_id], skip_special_tokens=False) == text


def test_byte_fallback_pieces_are_their_byte_and_the_space_mark_a_space() -> None:
    tokenizer = TOKENIZERS["byte_fallback"]
    table = token_bytes_table(tokenizer)
    assert table.of([tokenizer.token_to_id("<0xE4>"), tokenizer.token_to_id("▁h")]) == [b"\xe4", b" h"]


def test_a_byte_level_token_of_part_of_a_character_keeps_its_raw_bytes() -> None:
    table = token_bytes_table(BYTE_LEVEL)
    ids = BYTE_LEVEL.encode("🙂").ids
    assert len(ids) > 1 and b"".join(table.of(ids)) == "🙂".encode()
    assert any(not _is_utf8(own) for own in table.of(ids))


def test_special_tokens_are_their_content_and_ids_past_the_vocabulary_have_no_bytes() -> None:
    table = token_bytes_table(BYTE_LEVEL)
    size = BYTE_LEVEL.get_vocab_size(with_added_tokens=True)
    assert table.of([BYTE_LEVEL.token_to_id(EOS), size, size + 100]) == [EOS.encode(), b"", b""]


def test_a_decoder_it_does_not_know_falls_back_to_decoding_each_token() -> None:
    vocab = {"[UNK]": 0, "un": 1, "##able": 2}
    tokenizer = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.decoder = decoders.WordPiece()
    assert token_bytes_table(tokenizer).table == tuple(
        tokenizer.decode([i], skip_special_tokens=False).encode() for i in range(3)
    )


@pytest.mark.parametrize("content", ["łódź", "café au lait", "Ġx y", "Ōsaka"])
def test_an_added_token_with_any_character_outside_the_byte_alphabet_is_its_own_utf8(content: str) -> None:
    # "ó", "é" and "Ġ" are in the byte alphabet, "ł", " " and "Ō" are not: the library's ByteLevel
    # decoder maps an entry back only when all of its characters are in it.
    tokenizer = Tokenizer.from_str(BYTE_LEVEL.to_str())
    tokenizer.add_tokens([AddedToken(content, normalized=False)])
    token_id = tokenizer.token_to_id(content)
    assert token_bytes_table(tokenizer).of([token_id]) == [content.encode()]
    assert tokenizer.decode([token_id], skip_special_tokens=False) == content


def test_a_replace_of_a_regex_falls_back_to_decoding_each_token() -> None:
    vocab = {"<unk>": 0, "▁hello": 1, "__x": 2}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.decoder = decoders.Sequence([decoders.Replace(Regex("_+"), " "), decoders.Replace("▁", " ")])
    assert token_bytes_table(tokenizer).table == (b"<unk>", b" hello", b" x")


@pytest.mark.parametrize(
    ("steps", "expected"),
    [
        # After ByteLevel, on the decoded text: it was ignored ("a" stayed b"a").
        (
            [decoders.ByteLevel(), decoders.Replace("a", "b")],
            [b"b", " bé".encode(), b"\xc3"],
        ),
        # Before it, on the entry's characters: "Ġ" was read as the space it stands for.
        (
            [decoders.Replace("Ġ", "a"), decoders.ByteLevel()],
            [b"a", "aaé".encode(), b"\xc3"],
        ),
    ],
    ids=["after", "before"],
)
def test_a_string_replace_beside_byte_level_applies_on_its_side(
    steps: list[decoders.Decoder], expected: list[bytes]
) -> None:
    # Entries "a", "ĠaÃ©" (" aé" in the byte alphabet) and "Ã" (part of "é"), IDs 0, 1, 2.
    tokenizer = Tokenizer(models.BPE({"a": 0, "ĠaÃ©": 1, "Ã": 2}, []))
    tokenizer.decoder = decoders.Sequence(steps)
    table = token_bytes_table(tokenizer)
    assert table.of([0, 1, 2]) == expected
    for token_id, own in enumerate(expected):  # the library's decode, but where bytes are no text
        assert tokenizer.decode([token_id]) == own.decode(errors="replace")


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True
