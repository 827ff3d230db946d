"""GGUF import of a SentencePiece vocabulary (`tokenizer.ggml.model` "llama": Llama 2, Mistral).

The reference is transformers' own GGUF reader (AutoTokenizer with gguf_file=) on the same file, an
independent reading of the same fields. Its prefix space follows Metaspace's "first" scheme, which
differs from llama.cpp (and from Llama 2's and Mistral's own tokenizer.json, a Prepend normalizer) in
two places: llama.cpp puts the prefix before every run of text after a special token, not only the
first, and before a text that already starts with a space. There the reference is transformers'
tokenization of each run alone, given one space more where the run starts with one, joined with the
special tokens' ids: llama.cpp's rule with transformers' merges. Where the benchmark peer
llama-cpp-python is installed, llama.cpp's own tokenizer reading the file is the reference too.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
import subprocess
from pathlib import Path

import pytest
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from common.tests.common.gguf_files import SentencePieceFields, sentencepiece_fields, small_model, write_gguf
from tandem.common.torch_part.gguf_import import GGUFImportError, import_gguf
from tandem.common.torch_part.gguf_sentencepiece import merges_from_scores

REPO_ROOT = Path(__file__).resolve().parents[3]
# llama-cpp-python, llama.cpp's own tokenizer: a benchmark peer in its own venv (bench/peers/llama_cpp.sh).
LLAMA_CPP_PYTHON = REPO_ROOT / "bench" / "peers" / ".venv-llama-cpp" / "bin" / "python"
TEMPLATE = "{{ bos_token }}{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}"
TEXTS = [
    "hello world",
    "Hello world, the thing!",
    "  hello",
    " leading space",
    "two  spaces and    four",
    "line one\nline two\n\n",
    "\n",
    " ",
    "日本語 and é and ü",
    "emoji 🙂 falls back to bytes",
    "tab\there",
    "",
]
LITERAL_TEXTS = [
    "<s>hello</s> the",
    "a<s> b",
    "<s>[INST] hi [/INST]",
    "<tool>in the",
    "x</s>",
    "<unk>?",
]


def _write(directory: Path, fields: SentencePieceFields, **kwargs: object) -> Path:
    model = small_model("llama", len(fields.tokens))
    return write_gguf(directory / "model.gguf", model, fields, **kwargs)


@pytest.fixture(scope="module")
def imported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the GGUF file, its imported checkpoint directory)."""
    tmp = tmp_path_factory.mktemp("spm")
    path = _write(tmp, sentencepiece_fields(), chat_template=TEMPLATE)
    return path, import_gguf(path, tmp / "imported", dtype="float32")


@pytest.fixture(scope="module")
def reference(imported: tuple[Path, Path]):
    path, _ = imported
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def _llama_cpp_ids(reference, text: str) -> list[int]:
    """BOS, then each run of text between special literals tokenized by the reference alone, with a
    space more where it starts with one (Metaspace adds none there, llama.cpp does), the literals as
    their ids."""
    specials = sorted((t.content for t in reference.added_tokens_decoder.values()), key=len, reverse=True)
    ids = [reference.bos_token_id]
    for run in re.split(f"({'|'.join(map(re.escape, specials))})", text):
        if run in specials:
            ids.append(reference.convert_tokens_to_ids(run))
        elif run:
            ids += reference(" " + run if run.startswith(" ") else run, add_special_tokens=False)["input_ids"]
    return ids


def test_text_tokenizes_and_decodes_as_transformers_reads_the_file(imported, reference) -> None:
    _, out = imported
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    for text in TEXTS:
        ids = tokenizer.encode(text).ids
        assert ids == _llama_cpp_ids(reference, text), text
        if not text.startswith(" "):  # where the two rules agree, the reference as it is
            assert ids == reference(text)["input_ids"], text
        assert ids[0] == 1  # BOS: the file says add_bos_token
        assert tokenizer.decode(ids) == reference.decode(ids, skip_special_tokens=True) == text, text
        assert tokenizer.decode(ids, skip_special_tokens=False) == reference.decode(ids), text


def test_a_text_starting_with_a_space_gets_the_prefix_space_too_as_in_llama_cpp(imported) -> None:
    _, out = imported
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tokenizer.encode("  hello", add_special_tokens=False).tokens == ["▁▁", "▁hello"]
    assert tokenizer.decode(tokenizer.encode("  hello").ids) == "  hello"


def test_byte_fallback_spells_characters_no_piece_holds_and_decodes_them_back(imported) -> None:
    _, out = imported
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    encoding = tokenizer.encode("\n日", add_special_tokens=False)
    assert encoding.tokens == ["▁", "<0x0A>", "<0xE6>", "<0x97>", "<0xA5>"]
    assert tokenizer.decode(encoding.ids) == "\n日"


def test_special_literals_are_whole_tokens_and_the_text_after_them_gets_the_prefix_space(
    imported, reference
) -> None:
    _, out = imported
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    for text in LITERAL_TEXTS:
        assert tokenizer.encode(text).ids == _llama_cpp_ids(reference, text), text
        ids = tokenizer.encode(text).ids
        assert tokenizer.decode(ids, skip_special_tokens=False) == reference.decode(ids), text
    # As llama.cpp: "<s>[INST]" is BOS then "▁[INST]", the spelling Llama 2 and Mistral were trained on.
    tokens = tokenizer.encode("<s>[INST] hi", add_special_tokens=False).tokens
    assert tokens == ["<s>", "▁", "[", "I", "N", "S", "T", "]", "▁", "h", "i"]


def test_merges_the_file_lists_are_used_as_they_are(imported, reference, tmp_path: Path) -> None:
    fields = sentencepiece_fields()
    merges = [f"{left} {right}" for left, right in merges_from_scores(fields.tokens, fields.scores)]
    # Scores that would rank every merge the other way round: only the listed order can give the ids.
    listed = dataclasses.replace(fields, merges=merges, scores=[-s for s in fields.scores])
    out = import_gguf(_write(tmp_path, listed), tmp_path / "out", dtype="float32")
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    for text in TEXTS:
        assert tokenizer.encode(text).ids == _llama_cpp_ids(reference, text), text


def test_the_files_config_names_the_special_tokens_template_and_eos(imported) -> None:
    _, out = imported
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"], config["unk_token"]) == ("<s>", "</s>", "<unk>")
    assert config["add_bos_token"] is True and config["chat_template"] == TEMPLATE
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [2]


def test_a_file_without_add_bos_token_adds_bos_as_llama_cpp_does(tmp_path: Path) -> None:
    out = import_gguf(
        _write(tmp_path, dataclasses.replace(sentencepiece_fields(), add_bos=None)), tmp_path / "o"
    )
    assert Tokenizer.from_file(str(out / "tokenizer.json")).encode("hi").tokens == ["<s>", "▁", "h", "i"]
    assert json.loads((out / "tokenizer_config.json").read_text())["add_bos_token"] is True


def test_no_space_prefix_when_the_file_says_so(tmp_path: Path) -> None:
    path = _write(tmp_path, dataclasses.replace(sentencepiece_fields(), add_space_prefix=False))
    out = import_gguf(path, tmp_path / "out")
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tokenizer.encode("hello world", add_special_tokens=False).tokens == ["he", "llo", "▁world"]
    assert tokenizer.decode(tokenizer.encode(" hello").ids) == " hello"


def _refusal(tmp_path: Path, fields: SentencePieceFields, metadata: dict | None = None) -> str:
    path = _write(tmp_path, fields, metadata=metadata)
    with pytest.raises(GGUFImportError) as caught:
        import_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"{path}: ")
    return message.removeprefix(f"{path}: ")


def test_scores_of_the_wrong_length_are_refused_naming_the_field(tmp_path: Path) -> None:
    fields = sentencepiece_fields()
    size = len(fields.tokens)
    said = _refusal(tmp_path, fields, {"tokenizer.ggml.scores": fields.scores[:-3]})
    assert said == f"tokenizer.ggml.scores has {size - 3} entries for {size} tokenizer.ggml.tokens"


def test_a_file_without_scores_is_refused_naming_the_field(tmp_path: Path) -> None:
    fields = sentencepiece_fields()
    said = _refusal(tmp_path, fields, {"tokenizer.ggml.scores": "none"})
    assert said.startswith("metadata tokenizer.ggml.scores must be an array, got 'none'")


def test_an_unknown_token_type_is_refused_naming_the_entry(tmp_path: Path) -> None:
    fields = sentencepiece_fields()
    types = [*fields.types[:-1], 9]
    said = _refusal(tmp_path, fields, {"tokenizer.ggml.token_type": types})
    assert said.startswith(f"tokenizer.ggml.token_type[{len(types) - 1}] is 9, not a token type (1 normal, ")


def test_a_byte_type_piece_that_spells_no_byte_is_refused(tmp_path: Path) -> None:
    fields = sentencepiece_fields()
    types = list(fields.types)
    types[fields.tokens.index("▁hello")] = 6
    said = _refusal(tmp_path, fields, {"tokenizer.ggml.token_type": types})
    assert said == (
        f"tokenizer.ggml.tokens[{fields.tokens.index('▁hello')}] '▁hello' is of token_type 6 (byte) "
        "but is not one of <0x00>..<0xFF>"
    )


def test_a_duplicate_piece_is_refused_naming_both_entries(tmp_path: Path) -> None:
    fields = sentencepiece_fields()
    tokens = list(fields.tokens)
    tokens[-1] = "▁world"
    said = _refusal(tmp_path, fields, {"tokenizer.ggml.tokens": tokens})
    assert (
        said
        == f"tokenizer.ggml.tokens[{len(tokens) - 1}] '▁world' repeats entry {fields.tokens.index('▁world')}"
    )


def test_a_missing_byte_piece_is_refused_where_byte_fallback_needs_it(tmp_path: Path) -> None:
    fields = sentencepiece_fields()
    tokens, types = list(fields.tokens), list(fields.types)
    tokens[3 + 0x0A], types[3 + 0x0A] = "<newline>", 1  # "\n" is no piece: its byte is needed
    said = _refusal(tmp_path, dataclasses.replace(fields, tokens=tokens, types=types))
    assert (
        said == "tokenizer.ggml.tokens has no <0x0A>, the byte fallback piece for a character no piece spells"
    )


def test_a_missing_byte_piece_is_accepted_where_its_character_is_a_piece(tmp_path: Path) -> None:
    fields = sentencepiece_fields()
    tokens, types = list(fields.tokens), list(fields.types)
    tokens[3 + ord("e")], types[3 + ord("e")] = "<e-byte>", 1  # "e" is a piece: its byte is never needed
    out = import_gguf(
        _write(tmp_path, dataclasses.replace(fields, tokens=tokens, types=types)), tmp_path / "o"
    )
    assert Tokenizer.from_file(str(out / "tokenizer.json")).encode("e", add_special_tokens=False).tokens == [
        "▁",
        "e",
    ]


def test_a_listed_merge_of_pieces_not_in_the_vocabulary_is_refused(tmp_path: Path) -> None:
    fields = dataclasses.replace(sentencepiece_fields(), merges=["▁ t", "q z"])
    said = _refusal(tmp_path, fields)
    assert said == "tokenizer.ggml.merges[1] 'q z': 'qz' is not in tokenizer.ggml.tokens"


def test_a_nan_score_is_refused(tmp_path: Path) -> None:
    fields = sentencepiece_fields()
    scores = [*fields.scores[:-1], float("nan")]
    said = _refusal(tmp_path, fields, {"tokenizer.ggml.scores": scores})
    assert said == f"tokenizer.ggml.scores[{len(scores) - 1}] must be a finite number, got nan"


_LLAMA_CPP_TOKENIZE = """
import json, sys
import llama_cpp
vocab = llama_cpp.Llama(model_path=sys.argv[1], vocab_only=True, verbose=False)
texts = json.load(sys.stdin)
def ids(text, parsed):
    return vocab.tokenize(text.encode(), add_bos=parsed, special=parsed)
print(json.dumps([[ids(t, True), ids(t, False)] for t in texts]))
"""


@pytest.mark.skipif(not LLAMA_CPP_PYTHON.exists(), reason="no llama.cpp peer (bench/peers/llama_cpp.sh)")
def test_ids_equal_llama_cpps_own_tokenizer_reading_the_file(imported) -> None:
    """llama.cpp tokenizes the same file: specials parsed (a chat template's text), and as plain text (a
    caller's, through the decoder's literal twin), on the texts above and a thousand random ones."""
    path, out = imported
    rng = random.Random(0)
    alphabet = [*"helowrdtain \n<s>/[]é日▁", "<s>", "</s>", "<unk>", "<tool>", "  "]
    texts = TEXTS + LITERAL_TEXTS
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 24))) for _ in range(1000)]
    result = subprocess.run(
        [str(LLAMA_CPP_PYTHON), "-c", _LLAMA_CPP_TOKENIZE, str(path)],
        input=json.dumps(texts),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    literal = Tokenizer.from_file(str(out / "tokenizer.json"))
    literal.encode_special_tokens = True
    for text, (with_specials, plain) in zip(texts, json.loads(result.stdout), strict=True):
        assert tokenizer.encode(text).ids == with_specials, text
        assert literal.encode(text, add_special_tokens=False).ids == plain, text
