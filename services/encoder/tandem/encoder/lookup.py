"""The lookup embedder: the decoder checkpoint's own token-embedding table, read on the host.

Its rows are exactly what the decoder computes on the token path (`embed_tokens(input_ids)`),
so sending them as an embedding segment reproduces a token prompt bit for bit when both sides use
the same dtype. Only `model.embed_tokens.weight` is read from the checkpoint (one memory-mapped
tensor, found through the shard index when there is one), never the layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from tokenizers import Tokenizer

from tandem.common import checkpoint, text_bounds, vision_language
from tandem.common.quantization_config import quantization_refusal
from tandem.common.torch_part.quantized_tensor import quantize_table
from tandem.common.torch_part.weight_files import INDEX_NAME, index_files, weight_names
from tandem.common.weight_shapes import mismatch, token_table, type_refusal
from tandem.encoder.embedder import (
    EmbedderInfo,
    EmbedderLoadError,
    Pooling,
    mean_pool,
    read_header,
    read_tensor,
)

EMBED_KEY = "model.embed_tokens.weight"

# What serves in place of a checkpoint quantized for another loader. The encoder's --quantization takes
# int8 and int4 alone (a GGUF file's table needs no rounding here), so gguf is named as the decoder's.
QUANTIZED_ELSEWHERE = (
    "Serve the bf16, fp16 or fp32 checkpoint it was quantized from (with the decoder's --quantization "
    "int8 or int4 here too, to round the table alike), or a GGUF file as --model, which the decoder "
    "serves with --quantization gguf (docs/DEPLOYMENT.md)"
)


@dataclass(frozen=True)
class ModelShape:
    """What the encoder needs to know of a decoder checkpoint."""

    hidden_size: int  # width of the decoder's hidden states
    vocab_size: int  # rows of its embedding table


def read_json(path: Path) -> dict[str, Any]:
    return checkpoint.read_json(path, EmbedderLoadError)


def check_architectures(hf_config: dict[str, Any], model_dir: Path) -> None:
    """config.json's `architectures` is absent or a list of names: 5, an object or a list of lists made
    the vision-language test (vision_language.is_vision_language) raise TypeError or KeyError, a
    traceback at start. Raises EmbedderLoadError."""
    architectures = hf_config.get("architectures")
    if architectures is None or (
        isinstance(architectures, list) and all(isinstance(name, str) for name in architectures)
    ):
        return
    if isinstance(architectures, list):
        got = "a list holding " + next(type(a).__name__ for a in architectures if not isinstance(a, str))
    else:
        got = type(architectures).__name__
    raise EmbedderLoadError(f"config.json in {model_dir}: architectures must be a list of names, got {got}")


def read_model_shape(model_dir: Path) -> ModelShape:
    """hidden_size and vocab_size from the decoder checkpoint's config.json."""
    config = read_json(model_dir / "config.json")
    values = {}
    for key in ("hidden_size", "vocab_size"):
        value = config.get(key)
        if not isinstance(value, int) or value < 1:
            raise EmbedderLoadError(
                f"config.json in {model_dir}: {key} must be a positive integer, got {value!r}"
            )
        values[key] = value
    return ModelShape(**values)


def read_embedding_table(model_dir: Path) -> torch.Tensor:
    """`model.embed_tokens.weight` alone, from model.safetensors or the shard that holds it."""
    shards = index_files(model_dir, EmbedderLoadError)
    if shards is not None:
        path = shards.get(EMBED_KEY)
        if path is None:
            raise EmbedderLoadError(f"{EMBED_KEY} is not listed in {model_dir / INDEX_NAME}")
    else:
        path = model_dir / "model.safetensors"
    return read_tensor(path, EMBED_KEY)  # [vocab_size, hidden_size]


@dataclass(frozen=True)
class LanguageModelTable:
    """Where a vision-language checkpoint keeps its language model's token table."""

    name: str  # the table's tensor name in the files: EMBED_KEY under the architecture's prefix
    shape: ModelShape  # [vocab_size, hidden_size] as config.json's text_config states them
    files: dict[str, Path]  # every tensor's name -> the safetensors file that holds it


def language_model_table(model_dir: Path, hf_config: dict[str, Any]) -> LanguageModelTable:
    """The token table of the vision-language checkpoint in `model_dir` (`hf_config`: its config.json):
    its name, its shape and the files, from config.json and the safetensors headers; nothing of the
    table is read. Raises EmbedderLoadError."""
    text = vision_language.text_config(hf_config, EmbedderLoadError)
    hidden_size, vocab_size = text.get("hidden_size"), text.get("vocab_size")
    if not isinstance(hidden_size, int) or not isinstance(vocab_size, int):
        raise EmbedderLoadError(f"config.json in {model_dir}: text_config needs hidden_size and vocab_size")
    try:
        files = weight_names(model_dir, EmbedderLoadError)
    except (SafetensorError, OSError) as e:  # model.safetensors' header, listed (an index opens no shard)
        path = model_dir / "model.safetensors"
        raise EmbedderLoadError(f"{path} is not a readable safetensors file: {e}") from None
    layout = vision_language.weight_layout(hf_config["architectures"][0], files, EmbedderLoadError)
    shape = ModelShape(hidden_size=hidden_size, vocab_size=vocab_size)
    return LanguageModelTable(name=layout.checkpoint_name(EMBED_KEY), shape=shape, files=files)


class TableShapeError(EmbedderLoadError):
    """The token table's shape in its file is not the one config.json implies, or its type is not one a
    weight is read from, or config.json has a quantization_config (quantized data: a cast would serve
    other numbers than the decoder's, which refuses such a checkpoint too)."""


def check_table_shape(model_dir: Path) -> None:
    """The token table (`model.embed_tokens.weight`, or a vision-language checkpoint's language model's)
    is [vocab_size, hidden_size] as config.json (its text_config) states them, stored in a float type
    the decoder reads too (weight_shapes.WEIGHT_DTYPES), judged from the safetensors header alone:
    nothing of the table is read, so a service runs it before it listens, and config.json names no
    quantization method (quantization_config.quantization_refusal, as the decoder's check). Raises
    TableShapeError for a disagreement, EmbedderLoadError for a file that cannot be read."""
    hf_config = read_json(model_dir / "config.json")
    check_architectures(hf_config, model_dir)
    if (refusal := quantization_refusal(hf_config, QUANTIZED_ELSEWHERE)) is not None:
        raise TableShapeError(f"{model_dir / 'config.json'}: {refusal}")
    if vision_language.is_vision_language(hf_config):
        table = language_model_table(model_dir, hf_config)
        name, shape, path = table.name, table.shape, table.files.get(table.name)
    else:
        shape = read_model_shape(model_dir)
        name, shards = EMBED_KEY, index_files(model_dir, EmbedderLoadError)
        path = model_dir / "model.safetensors" if shards is None else shards.get(name)
    if path is None:
        raise EmbedderLoadError(f"{name} is not listed in {model_dir / INDEX_NAME}")
    expected = token_table(shape.vocab_size, shape.hidden_size)
    stored, stored_type = read_header(path, name)
    refusal = mismatch(name, stored, expected, "config.json") or type_refusal(name, stored_type)
    if refusal is not None:
        raise TableShapeError(f"{path}: {refusal}")


def check_tokenizer_fits(
    tokenizer: Tokenizer, vocab_size: int, model_dir: Path, is_vision_language: bool = False
) -> None:
    """Every token of `tokenizer` (`model_dir`'s) has a row of a table of `vocab_size`, config.json's or
    a vision-language checkpoint's text_config's. Raises EmbedderLoadError naming both files."""
    num_tokens = tokenizer.get_vocab_size(with_added_tokens=True)
    if num_tokens > vocab_size:
        stated = vision_language.stated_vocab_size(model_dir, vocab_size, is_vision_language)
        raise EmbedderLoadError(f"{model_dir / 'tokenizer.json'} has {num_tokens} tokens, more than {stated}")


def read_tokenizer(model_dir: Path) -> Tokenizer:
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise EmbedderLoadError(f"tokenizer.json not found in {model_dir}")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as error:  # the tokenizers library raises Exception itself (a lone surrogate: a
        # traceback at start), and never a narrower one
        raise EmbedderLoadError(f"{path}: not a tokenizer the tokenizers library reads: {error}") from None


def as_decoder_has_it(table: torch.Tensor, dtype: torch.dtype, quantization: str, name: str) -> torch.Tensor:
    """The token table as the decoder holds it: the same cast its loader applies, so rows match its
    embed_tokens exactly, and rounded as its --quantization int8 / int4 rounds it (8-bit per row), for
    the same reason. Raises EmbedderLoadError naming the weight."""
    table = table.to(dtype)
    if quantization == "none":
        return table
    try:
        return quantize_table(table).dequantize(dtype)
    except ValueError as e:  # rows not a whole number of blocks of 32
        raise EmbedderLoadError(f"--quantization {quantization}: {name}: {e}") from None


class LookupEmbedder:
    """Rows of the decoder's embedding table, indexed by the decoder tokenizer's IDs."""

    def __init__(self, table: torch.Tensor, tokenizer: Tokenizer, kind: str = "lookup") -> None:
        self.table = table  # [vocab_size, hidden_size] in the native dtype
        self.tokenizer = tokenizer
        self._info = EmbedderInfo(
            kind=kind,
            hidden_size=table.shape[1],
            vocab_size=table.shape[0],
            dtype=table.dtype,
            max_token_chars=text_bounds.max_token_chars(tokenizer),
        )

    @classmethod
    def load(
        cls,
        model_dir: Path,
        dtype: torch.dtype,
        quantization: str = "none",
        tokenizer: Tokenizer | None = None,
    ) -> LookupEmbedder:
        """`tokenizer`: model_dir's, already parsed (the __main__ parses it before listening), else
        read here."""
        if not model_dir.is_dir():
            raise EmbedderLoadError(f"model directory {model_dir} does not exist")
        shape = read_model_shape(model_dir)
        check_table_shape(model_dir)  # the __main__ checked it before listening; the files may have changed
        table = read_embedding_table(model_dir)
        if tokenizer is None:
            tokenizer = read_tokenizer(model_dir)
        check_tokenizer_fits(tokenizer, shape.vocab_size, model_dir)
        return cls(as_decoder_has_it(table, dtype, quantization, EMBED_KEY), tokenizer)

    @property
    def info(self) -> EmbedderInfo:
        return self._info

    def tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        # encode_batch releases the GIL (encode holds it for the whole text): health probes and
        # other calls keep being answered while a long text tokenizes on the worker thread.
        return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def rows(self, token_ids: list[int]) -> torch.Tensor:
        """[len(token_ids), hidden_size], a copy of the table's rows."""
        # index_select, not advanced indexing: one plain gather, 5-7 times faster on 576 x 4,096 bf16.
        return torch.index_select(self.table, 0, torch.tensor(token_ids, dtype=torch.long))

    def embed_into(self, token_ids: list[int], out: torch.Tensor) -> None:
        # out: [len(token_ids), hidden_size] in the table's dtype: the gather writes there, nowhere else.
        torch.index_select(self.table, 0, torch.tensor(token_ids, dtype=torch.long), out=out)

    def embed(self, token_ids: list[int], pooling: Pooling) -> torch.Tensor:
        rows = self.rows(token_ids)  # [num_tokens, hidden_size]
        return mean_pool(rows) if pooling is Pooling.MEAN else rows
