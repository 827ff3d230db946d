"""GGUF import: small files written here (Llama and Qwen3), checked against the original weights; bad
files get one-line errors. That the decoder generates from an imported file what transformers does,
for each quantization type we can write, is the decoder's test (services/decoder/tests/models/
test_imported_gguf.py)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from common.tests.common.gguf_files import small_model, write_gguf
from tandem.common.torch_part.gguf_import import GGUFImportError, import_gguf, readable_types

Q = gguf.GGMLQuantizationType
REPO_ROOT = Path(__file__).resolve().parents[3]
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def source(request: pytest.FixtureRequest, tokenizer: Tokenizer, tmp_path_factory: pytest.TempPathFactory):
    """(HF model, its GGUF file in F32, the imported checkpoint directory)."""
    model = small_model(request.param, tokenizer.get_vocab_size())
    tmp = tmp_path_factory.mktemp(f"gguf-{request.param}")
    path = write_gguf(tmp / "model.gguf", model, tokenizer, chat_template=TEMPLATE)
    return model, path, import_gguf(path, tmp / "imported", dtype="float32")


def test_imported_weights_equal_the_originals_with_the_llama_qk_permutation_undone(source) -> None:
    model, _, out = source
    weights = load_file(out / "model.safetensors")
    expected = {
        k: v
        for k, v in model.state_dict().items()
        if not (k == "lm_head.weight" and "lm_head.weight" not in weights)
    }
    assert weights.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(weights[name], tensor), name


def test_config_tokenizer_and_template_files_describe_the_model(source, tokenizer: Tokenizer) -> None:
    model, _, out = source
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [type(model).__name__]
    assert config["num_key_value_heads"] == 2 and config["head_dim"] == model.config.head_dim
    assert config["tie_word_embeddings"] == model.config.tie_word_embeddings
    imported = Tokenizer.from_file(str(out / "tokenizer.json"))
    for text in ["Once upon a time, 123 cats", "  two  spaces\n\nand lines", "<|im_start|>user\nhi"]:
        assert imported.encode(text).ids == tokenizer.encode(text).ids, text
        assert imported.decode(imported.encode(text).ids, skip_special_tokens=False) == text
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tokenizer_config["chat_template"] == TEMPLATE == (out / "chat_template.jinja").read_text()
    assert tokenizer_config["eos_token"] == "<|endoftext|>"
    eos = tokenizer.token_to_id("<|endoftext|>")
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [eos]


def test_checkpoint_files_are_readable_by_other_users(source) -> None:
    _, _, out = source
    assert out.stat().st_mode & 0o777 == 0o755
    for path in out.iterdir():
        assert path.stat().st_mode & 0o777 == 0o644, path.name


def test_bfloat16_is_the_default_dtype_of_the_written_weights(source, tmp_path: Path) -> None:
    _, path, _ = source
    weights = load_file(import_gguf(path, tmp_path / "bf16") / "model.safetensors")
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tandem.cli", "import-gguf", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )


def _assert_one_line_error(result: subprocess.CompletedProcess, *words: str) -> None:
    assert result.returncode == 2, result.stderr
    # Not a terminal: no progress line, the error alone.
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("tandem import-gguf: "), result.stderr
    for word in words:
        assert word in lines[0], lines[0]


def test_cli_imports_a_file_and_prints_the_directory(source, tmp_path: Path) -> None:
    _, path, _ = source
    result = _cli(str(path), str(tmp_path / "out"), "--dtype", "float16")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(tmp_path / "out")
    # Not a terminal: one summary line, no \r rewrites (a log kept every one of them, on one line).
    num_tensors = len(load_file(tmp_path / "out" / "model.safetensors"))
    assert result.stderr == f"imported model.gguf: {num_tensors} tensors\n"
    assert load_file(tmp_path / "out" / "model.safetensors")["model.norm.weight"].dtype == torch.float16


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_sees_one_progress_line_rewritten_in_place(
    source, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tandem.cli import _import_gguf

    _, path, _ = source
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert _import_gguf(path, tmp_path / "out", "float32") == 0
    num_tensors = len(load_file(tmp_path / "out" / "model.safetensors"))
    rewrites = terminal.getvalue().split("\r")
    assert rewrites[0] == "" and len(rewrites) == num_tensors + 1
    assert rewrites[-1] == f"importing model.gguf: {num_tensors}/{num_tensors} tensors\n"


def test_wrong_magic_is_one_line_exit_2(tmp_path: Path) -> None:
    (tmp_path / "x.gguf").write_bytes(b"PK\x03\x04" + bytes(100))
    _assert_one_line_error(_cli(str(tmp_path / "x.gguf"), str(tmp_path / "out")), "not a GGUF file", "magic")


def test_truncated_file_is_one_line_exit_2(source, tmp_path: Path) -> None:
    _, path, _ = source
    data = path.read_bytes()
    for cut in (len(data) - 1000, 200):  # inside the tensor data, then inside the header
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        _assert_one_line_error(_cli(str(tmp_path / "cut.gguf"), str(tmp_path / "out")), "truncated")


def test_unsupported_architecture_is_named_with_the_supported_ones(tmp_path: Path) -> None:
    writer = gguf.GGUFWriter(str(tmp_path / "falcon.gguf"), "falcon")
    writer.add_tensor("token_embd.weight", torch.zeros(4, 32).numpy())
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        write()
    writer.close()
    _assert_one_line_error(
        _cli(str(tmp_path / "falcon.gguf"), str(tmp_path / "out")), "'falcon'", "llama", "qwen3"
    )


def test_a_type_gguf_cannot_dequantize_is_named(tokenizer: Tokenizer, tmp_path: Path) -> None:
    model = small_model("qwen3", tokenizer.get_vocab_size())
    q8_1 = np.zeros(2 * 40, dtype=np.uint8)  # two Q8_1 blocks: the 64 values of the final norm
    path = write_gguf(
        tmp_path / "m.gguf", model, tokenizer, raw_tensors={"output_norm.weight": (q8_1, Q.Q8_1)}
    )
    _assert_one_line_error(_cli(str(path), str(tmp_path / "out")), "output_norm.weight", "Q8_1")


def test_a_type_gguf_cannot_dequantize_is_refused_before_anything_is_imported(
    tokenizer: Tokenizer, tmp_path: Path
) -> None:
    """It was refused once every tensor before it was dequantized (minutes of a large file), the output
    directory made; the tensor infos name each type, so it is refused first, with the readable ones."""
    model = small_model("llama", tokenizer.get_vocab_size())
    q8_1 = np.zeros((128, 2 * 40), dtype=np.uint8)  # up_proj's 128 rows of two Q8_1 blocks of 32 values
    path = write_gguf(
        tmp_path / "m.gguf", model, tokenizer, Q.Q8_0, raw_tensors={"blk.1.ffn_up.weight": (q8_1, Q.Q8_1)}
    )
    with pytest.raises(GGUFImportError) as caught:
        import_gguf(path, tmp_path / "out")
    readable = readable_types()
    assert str(caught.value) == (
        f"{path}: tensor blk.1.ffn_up.weight is of GGML type Q8_1, which the gguf package cannot dequantize "
        f"(readable: {', '.join(readable)})"
    )
    assert not (tmp_path / "out").exists()
    assert {"F32", "F16", "BF16", "Q4_0", "Q8_0", "Q4_K", "Q6_K", "IQ4_XS"} <= set(readable)
    assert not {"Q8_1", "Q8_K", "I8", "I32", "F64"} & set(readable)


def test_an_unsupported_tokenizer_kind_is_named(tokenizer: Tokenizer, tmp_path: Path) -> None:
    path = write_gguf(
        tmp_path / "m.gguf", small_model("qwen3", tokenizer.get_vocab_size()), tokenizer, pre="mystery"
    )
    _assert_one_line_error(_cli(str(path), str(tmp_path / "out")), "tokenizer.ggml.pre", "'mystery'")


@pytest.mark.parametrize(
    ("arch", "metadata", "said"),
    [
        (
            "qwen3",
            {"qwen3.attention.head_count": 0},
            "qwen3.attention.head_count must be an integer in [1, 1024], got 0",
        ),
        (
            "llama",
            {"llama.attention.head_count_kv": 3},
            "head_count 4 is not a multiple of attention.head_count_kv 3",
        ),
        (
            "llama",
            {"llama.block_count": 10**9},
            "llama.block_count must be an integer in [1, 1024], got 1000000000",
        ),
        ("llama", {"llama.block_count": 3}, "llama.block_count is 3, the tensors hold blocks 0-1"),
        (
            "qwen3",
            {"qwen3.context_length": 2**40},
            "qwen3.context_length must be an integer in [1, 16777216]",
        ),
        (
            "qwen3",
            {"qwen3.embedding_length": -5},
            "qwen3.embedding_length must be an integer in [1, 131072], got -5",
        ),
        (
            "llama",
            {"tokenizer.ggml.bos_token_id": 10**6},
            "tokenizer.ggml.bos_token_id must be an integer in [0, ",
        ),
        (
            "llama",
            {"tokenizer.ggml.eos_token_id": 2**33},
            "tokenizer.ggml.eos_token_id must be an integer in [0, ",
        ),
        (
            "llama",
            {"llama.attention.layer_norm_rms_epsilon": "1e-5"},
            "llama.attention.layer_norm_rms_epsilon must be a number in (0, 1], got '1e-5'",
        ),
        (
            "qwen3",
            {"qwen3.attention.layer_norm_rms_epsilon": -0.25},
            "qwen3.attention.layer_norm_rms_epsilon must be a number in (0, 1], got -0.25",
        ),
        (
            "qwen3",
            {"qwen3.rope.freq_base": float("nan")},
            "qwen3.rope.freq_base must be a number in (0, 1e+12], got nan",
        ),
        (
            "qwen3",
            {"tokenizer.chat_template": "{{ 'a' }}" * 8000},
            "tokenizer.chat_template has 72000 characters",
        ),
    ],
)
def test_metadata_out_of_its_sane_range_is_one_line_exit_2_before_anything_is_sized(
    tokenizer: Tokenizer, tmp_path: Path, arch: str, metadata: dict, said: str
) -> None:
    # An untrusted file: block_count 10^9 used to import, then grow `serve` past 6 GB; head_count 0 was
    # a traceback; context_length 2^40 served, then failed every GetModelInfo.
    path = write_gguf(
        tmp_path / "m.gguf", small_model(arch, tokenizer.get_vocab_size()), tokenizer, metadata=metadata
    )
    with pytest.raises(GGUFImportError) as caught:  # the CLI prints it as one line, exit 2 (above)
        import_gguf(path, tmp_path / "out")
    assert said in str(caught.value) and "\n" not in str(caught.value)
    assert not (tmp_path / "out").exists()


def test_an_epsilon_stored_as_a_string_is_one_line_exit_2(tokenizer: Tokenizer, tmp_path: Path) -> None:
    # It used to end in a traceback (float() of the string) and exit 1.
    path = write_gguf(
        tmp_path / "m.gguf",
        small_model("llama", tokenizer.get_vocab_size()),
        tokenizer,
        metadata={"llama.attention.layer_norm_rms_epsilon": "0.00001"},
    )
    said = "llama.attention.layer_norm_rms_epsilon must be a number in (0, 1], got '0.00001'"
    _assert_one_line_error(_cli(str(path), str(tmp_path / "out")), said)
    assert not (tmp_path / "out").exists()


def test_a_vocabulary_entry_of_a_million_characters_is_refused(tokenizer: Tokenizer, tmp_path: Path) -> None:
    # The text bounds divide a text's length by the longest entry: one huge entry disabled them.
    model = small_model("qwen3", tokenizer.get_vocab_size())
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    tokens += [f"[PAD{i}]" for i in range(model.config.vocab_size - len(tokens))]
    tokens[-1] = "x" * 1_000_000
    path = write_gguf(tmp_path / "m.gguf", model, tokenizer, metadata={"tokenizer.ggml.tokens": tokens})
    said = f"tokenizer.ggml.tokens[{len(tokens) - 1}] has 1000000 characters, more than 1024"
    _assert_one_line_error(_cli(str(path), str(tmp_path / "out")), said)
    assert not (tmp_path / "out").exists()


def test_a_llama_q_projection_of_rows_no_heads_divide_is_one_line_exit_2(
    tokenizer: Tokenizer, tmp_path: Path
) -> None:
    """Undoing llama.cpp's permutation reshapes the rows by head: numpy's ValueError was a traceback.
    The rows are now refused against the metadata's heads before anything is dequantized."""
    q_proj = np.zeros((62, 64), dtype=np.float32)  # 4 heads of 16 rows take 64
    path = write_gguf(
        tmp_path / "m.gguf",
        small_model("llama", tokenizer.get_vocab_size()),
        tokenizer,
        raw_tensors={"blk.0.attn_q.weight": (q_proj, Q.F32)},
    )
    _assert_one_line_error(
        _cli(str(path), str(tmp_path / "out")),
        "weight blk.0.attn_q.weight has shape [62, 64] in the file",
        "the metadata implies [64, 64] (llama.attention.head_count 4 x llama.attention.key_length 16",
    )


@pytest.mark.parametrize(
    ("arch", "metadata", "said"),
    [
        (
            "llama",
            {"llama.attention.head_count": 2},
            "blk.0.attn_q.weight has shape [64, 64] in the file, but the metadata implies [32, 64] "
            "(llama.attention.head_count 2 x llama.attention.key_length 16, llama.embedding_length 64)",
        ),
        (
            "llama",
            {"llama.attention.head_count_kv": 4},
            "blk.0.attn_k.weight has shape [32, 64] in the file, but the metadata implies [64, 64] "
            "(llama.attention.head_count_kv 4 x llama.attention.key_length 16, llama.embedding_length 64)",
        ),
        (
            "qwen3",
            {"qwen3.attention.key_length": 64},
            "blk.0.attn_q.weight has shape [512, 64] in the file, but the metadata implies [256, 64] "
            "(qwen3.attention.head_count 4 x qwen3.attention.key_length 64, qwen3.embedding_length 64)",
        ),
        (
            "qwen3",
            {"qwen3.vocab_size": 2048},
            "token_embd.weight has shape [1024, 64] in the file, but the metadata implies [2048, 64] "
            "(qwen3.vocab_size 2048, qwen3.embedding_length 64)",
        ),
        (
            "llama",
            {"llama.feed_forward_length": 96},
            "blk.0.ffn_gate.weight has shape [128, 64] in the file, but the metadata implies [96, 64] "
            "(llama.feed_forward_length 96, llama.embedding_length 64)",
        ),
        (
            "llama",
            {"llama.embedding_length": 128},
            "token_embd.weight has shape [1024, 64] in the file, but the metadata implies [1024, 128] "
            "(llama.vocab_size 1024, llama.embedding_length 128)",
        ),
    ],
)
def test_metadata_that_disagrees_with_a_tensor_shape_is_refused_before_anything_is_imported(
    tokenizer: Tokenizer, tmp_path: Path, arch: str, metadata: dict, said: str
) -> None:
    """Such a file was imported whole, then refused by the decoder's load after it listened, naming
    the imported copy's tensor. The tensor infos are compared with the metadata before any is read."""
    path = write_gguf(
        tmp_path / "m.gguf", small_model(arch, tokenizer.get_vocab_size()), tokenizer, metadata=metadata
    )
    with pytest.raises(GGUFImportError) as caught:
        import_gguf(path, tmp_path / "out")
    assert str(caught.value) == f"{path}: weight {said}"
    assert not (tmp_path / "out").exists()


def test_a_qwen2_file_without_its_attention_biases_is_refused_before_anything_is_imported(
    tokenizer: Tokenizer, tmp_path: Path
) -> None:
    """Qwen2's layer has q/k/v biases whatever the file holds: without them the import would write a
    checkpoint the decoder refuses."""
    model = small_model("qwen2", tokenizer.get_vocab_size())
    model.model.layers[1].self_attn.k_proj.bias = None  # left out of the state dict, so of the file
    path = write_gguf(tmp_path / "m.gguf", model, tokenizer)
    with pytest.raises(GGUFImportError) as caught:
        import_gguf(path, tmp_path / "out")
    assert (
        str(caught.value)
        == f"{path}: tensor blk.1.attn_k.bias (model.layers.1.self_attn.k_proj.bias) is missing"
    )
    assert not (tmp_path / "out").exists()


def _vocabulary(tokenizer: Tokenizer, size: int) -> list[str]:
    """The entries write_gguf writes: the tokenizer's by id, then padding up to `size`."""
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    return tokens + [f"[PAD{i}]" for i in range(size - len(tokens))]


@pytest.mark.parametrize(
    ("key", "value", "said"),
    [
        # AttributeError and TypeError tracebacks before.
        ("tokenizer.ggml.merges", [7, 8], "metadata tokenizer.ggml.merges[0] must be a string, got 7"),
        ("tokenizer.ggml.tokens", "ints", "metadata tokenizer.ggml.tokens[0] must be a string, got 0"),
        # Each token then counted as a normal one: the special tokens were lost.
        ("tokenizer.ggml.token_type", "strings", "metadata tokenizer.ggml.token_type[0] must be an integer"),
        # Imported, then refused at load as an unreadable tokenizer.json of the cache directory.
        (
            "tokenizer.ggml.merges",
            ["a b", "abc"],
            "tokenizer.ggml.merges[1] 'abc' is not two tokens and a space",
        ),
        ("tokenizer.ggml.tokens", "repeat", "tokenizer.ggml.tokens[1] '!' repeats entry 0"),
        # "yes" was read as true.
        (
            "tokenizer.ggml.add_bos_token",
            "yes",
            "metadata tokenizer.ggml.add_bos_token must be a boolean, got 'yes'",
        ),
    ],
)
def test_tokenizer_metadata_of_the_wrong_kind_is_one_line_naming_the_entry(
    tokenizer: Tokenizer, tmp_path: Path, key: str, value: object, said: str
) -> None:
    model = small_model("qwen3", tokenizer.get_vocab_size())
    size = model.config.vocab_size
    value = (
        {
            "ints": list(range(size)),
            "strings": ["normal"] * size,
            "repeat": [_vocabulary(tokenizer, size)[0], *_vocabulary(tokenizer, size)[:-1]],
        }.get(value, value)
        if isinstance(value, str)
        else value
    )
    path = write_gguf(tmp_path / "m.gguf", model, tokenizer, metadata={key: value})
    with pytest.raises(GGUFImportError) as caught:
        import_gguf(path, tmp_path / "out")
    assert said in str(caught.value) and "\n" not in str(caught.value)


def test_a_directory_is_said_to_be_one(tmp_path: Path) -> None:
    """It said "no such file" of a directory that exists."""
    with pytest.raises(GGUFImportError, match="a directory, not a GGUF file"):
        import_gguf(tmp_path, tmp_path / "out")


def test_a_device_or_a_fifo_is_said_to_be_no_regular_file(tmp_path: Path) -> None:
    """/dev/zero and a FIFO were "no such file", though they exist (a review's run)."""
    fifo = tmp_path / "m.gguf"
    os.mkfifo(fifo)
    for path in (Path("/dev/zero"), fifo):
        with pytest.raises(GGUFImportError, match="not a regular file, not a GGUF file"):
            import_gguf(path, tmp_path / "out")
    with pytest.raises(GGUFImportError, match="no such file"):
        import_gguf(tmp_path / "absent.gguf", tmp_path / "out")
