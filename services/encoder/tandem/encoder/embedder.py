"""What every embedder offers the servicer: tokenize, embed, and a description of its output.

An embedder turns token IDs into rows in the decoder model's hidden space, `[num_rows, hidden_size]`
in its native dtype. The servicer validates requests against `EmbedderInfo` (vocabulary, length)
before calling `embed`, so embedders may assume valid, non-empty input. Embedders are not
thread-safe; the servicer runs them on one worker thread.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch
from safetensors import SafetensorError, safe_open


class Pooling(enum.StrEnum):
    """How the rows of one input are combined."""

    NONE = "none"  # one row per position: [num_rows, hidden_size]
    MEAN = "mean"  # the mean of the rows: [1, hidden_size]


class EmbedderLoadError(ValueError):
    """A model, adapter or projector that cannot be served; the message names the file at fault."""


def path_refusal(path: Path, is_dir: bool) -> str | None:
    """Why `path` cannot be the directory (`is_dir`) or file asked for, naming it; None when it can.
    A file given for a directory is said to be one (it was said not to exist)."""
    if path.is_dir() if is_dir else path.is_file():
        return None
    if not path.exists():
        return f"{path} does not exist"
    return f"{path} is not a directory" if is_dir else f"{path} is not a file"


def read_tensor(path: Path, key: str) -> torch.Tensor:
    """Tensor `key` alone from the safetensors file at `path` (nothing else is read).

    Raises EmbedderLoadError naming the file when it is missing or lacks the key.
    """
    if not path.is_file():
        raise EmbedderLoadError(f"{path.name} (holding {key}) not found in {path.parent}")
    with safe_open(path, framework="pt", device="cpu") as weights:
        if key not in weights.keys():
            raise EmbedderLoadError(f"{key} not found in {path} (keys: {sorted(weights.keys())})")
        return weights.get_tensor(key)


def read_header(path: Path, key: str) -> tuple[tuple[int, ...], str]:
    """Tensor `key`'s shape and safetensors type name ("BF16", "I32", ...) from the header at `path`
    (none of its data is read).

    Raises EmbedderLoadError naming the file when it is missing, unreadable or lacks the key.
    """
    if not path.is_file():
        raise EmbedderLoadError(f"{path.name} (holding {key}) not found in {path.parent}")
    try:
        with safe_open(path, framework="pt", device="cpu") as weights:
            if key not in weights.keys():
                raise EmbedderLoadError(f"{key} not found in {path}")
            stored = weights.get_slice(key)
            return tuple(stored.get_shape()), stored.get_dtype()
    except (SafetensorError, OSError) as e:  # SafetensorError is a bare Exception
        raise EmbedderLoadError(f"{path} is not a readable safetensors file: {e}") from None


# The longest image placeholder a checkpoint may name, in UTF-8 bytes, checked at load: every Embed reply
# of an image carries it within request.py's RESPONSE_OVERHEAD_BYTES (4,096), which holds no more. LLaVA's
# and SmolVLM's are "<image>", 7 bytes.
MAX_IMAGE_PLACEHOLDER_BYTES = 256


@dataclass(frozen=True)
class EmbedderInfo:
    """Static description of a loaded embedder, reported by GetModelInfo and used for validation."""

    kind: str  # "lookup", "soft-prompt" or "projector"
    hidden_size: int  # width of every output row: the decoder's hidden size
    vocab_size: int  # token IDs accepted are < vocab_size (the embedder's own vocabulary)
    dtype: torch.dtype  # native element type of the output rows
    max_token_chars: int  # the most characters of text one token stands for (tandem.common.text_bounds)
    max_positions: int | None = None  # most positions the embedder can read at once; None = no limit
    num_virtual_tokens: int = 0  # rows prepended to every input (soft prompts)
    image_placeholder: str = ""  # what an image's rows replace in the chat template; "" = no images


class Embedder(Protocol):
    @property
    def info(self) -> EmbedderInfo: ...

    def tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        """Token IDs of `text` in this embedder's vocabulary, with the GIL released while it works."""
        ...

    def embed(self, token_ids: list[int], pooling: Pooling) -> torch.Tensor:
        """Rows for non-empty, in-vocabulary `token_ids`: [num_rows, hidden_size] in info.dtype."""
        ...


@runtime_checkable
class EmbedsInto(Protocol):
    """An embedder whose rows for Pooling.NONE are one per token ID, which it can write into memory the
    caller gives (a shared-memory segment for a caller on this host): no copy of them of its own."""

    def embed_into(self, token_ids: list[int], out: torch.Tensor) -> None:
        """Writes the rows of non-empty, in-vocabulary `token_ids` into `out`:
        [len(token_ids), hidden_size] in info.dtype."""
        ...


def mean_pool(rows: torch.Tensor) -> torch.Tensor:
    """[num_rows, hidden] -> [1, hidden]; accumulates in float32 so bf16 inputs do not lose precision."""
    return rows.float().mean(dim=0, keepdim=True).to(rows.dtype)
