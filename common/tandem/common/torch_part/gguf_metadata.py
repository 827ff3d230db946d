"""A GGUF file's key-value metadata, read with errors that name the key: what the importer
(gguf_import.py) and the tokenizer it rebuilds (gguf_tokenizer.py) read a file's fields through."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# llama.cpp writes Mistral as "llama" (its Q/K rows permuted alike); a "qwen2" file is Qwen2 or Qwen2.5.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


class GGUFImportError(ValueError):
    """A GGUF file that cannot be converted; the message is one line naming the problem."""


class GGUFMetadata:
    """Typed access to the GGUF key-value fields, with errors that name the key."""

    def __init__(self, reader: Any, path: Path) -> None:
        self.reader, self.path = reader, path
        self.architecture = self.get_str("general.architecture")
        if self.architecture not in ARCHITECTURES:
            raise GGUFImportError(
                f"{path}: architecture {self.architecture!r} is not supported "
                f"(supported: {', '.join(sorted(ARCHITECTURES))})"
            )

    def get(self, key: str, default: Any = None) -> Any:
        field = self.reader.get_field(key)
        if field is None:
            return default
        try:
            return field.contents()
        except (ValueError, IndexError, TypeError) as e:
            raise GGUFImportError(f"{self.path}: metadata {key} unreadable ({one_line(e)})") from e

    def get_str(self, key: str) -> str | None:
        value = self.get(key)
        return value if isinstance(value, str) else None

    def arch(self, key: str, default: Any = None) -> Any:
        return self.get(f"{self.architecture}.{key}", default)

    def require(self, key: str) -> Any:
        value = self.arch(key)
        if value is None:
            raise GGUFImportError(f"{self.path}: metadata {self.architecture}.{key} is missing")
        return value


def int_in_range(meta: GGUFMetadata, key: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise GGUFImportError(
            f"{meta.path}: metadata {key} must be an integer in [{low}, {high}], got {value!r}"
        )
    return value


def list_of(meta: GGUFMetadata, key: str, kind: type) -> list[Any]:
    """The array under `key` ([] when absent); an entry of another type (a merge stored as an integer
    raised AttributeError, a token type stored as a string made every token a normal one) is named."""
    values = meta.get(key) or []
    if not isinstance(values, list):
        raise GGUFImportError(f"{meta.path}: metadata {key} must be an array, got {values!r:.40}")
    for i, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, kind):
            raise GGUFImportError(
                f"{meta.path}: metadata {key}[{i}] must be {'a string' if kind is str else 'an integer'}, "
                f"got {value!r:.40}"
            )
    return values


def flag(meta: GGUFMetadata, key: str, default: bool = False) -> bool:
    value = meta.get(key, default)
    if not isinstance(value, bool):  # "yes" read as true before
        raise GGUFImportError(f"{meta.path}: metadata {key} must be a boolean, got {value!r:.40}")
    return value


def one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__
