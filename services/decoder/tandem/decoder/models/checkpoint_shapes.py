"""A checkpoint's weights against its config.json, from the safetensors headers alone.

A config that disagrees with its weights (num_attention_heads 5 beside a q_proj of 9 heads' rows, a
vocab_size that is not embed_tokens' row count, an intermediate_size that is not gate_proj's) was
refused only by the load, once the model was built and each weight read: after the server listened,
exit 1. Every shape the model will read is implied by the config alone (common/weight_shapes.py), and
the loader has parsed every header before listening, so the two are compared there, reading no tensor;
so is each one's type (an FP8 checkpoint is refused there, before its scales are warned of below).

The weights the model does not read are looked at too (`check_unread`). One that the architecture
would read were a config flag the other way (a q_proj.bias beside attention_bias false, Qwen2's biases
under a LlamaForCausalLM config) was dropped in silence and the model served other outputs: it is
refused, naming the key. A separate lm_head beside tie_word_embeddings true is refused where it differs
from the token table (transformers then unties the head and warns; vLLM ties it: the config is wrong
either way) and only named where it equals it (both tie it, the outputs are the same). Older files'
rotary_emb.inv_freq buffers are passed over in silence, as transformers passes them over; any other is
named in one warning.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tandem.common.vision_language import PLAIN, TEXT_ARCHITECTURES, WeightLayout
from tandem.common.weight_shapes import (
    TextModelShape,
    expected_weights,
    flagged_weights,
    mismatch,
    type_refusal,
)
from tandem.decoder.models.config import ModelConfig
from tandem.decoder.models.registry import MODEL_CLASSES


def text_model_shape(config: ModelConfig) -> TextModelShape:
    """What sizes the weights of the model `config` builds (MODEL_CLASSES[config.architecture])."""
    return TextModelShape(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_layers=config.num_layers,
        num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        has_qk_norm=MODEL_CLASSES[config.architecture].use_qk_norm,
        is_tied=config.tie_word_embeddings,
        has_qkv_bias=config.qkv_bias,
        has_o_bias=config.o_bias,
        has_mlp_bias=config.mlp_bias,
    )


def check_shapes(
    file_of: dict[str, Any],  # checkpoint name -> the open safetensors file holding it
    path_of: dict[str, Path],  # checkpoint name -> that file's path
    layout: WeightLayout,  # where the language model's weights sit (a vision-language prefix)
    config: ModelConfig,
    model_dir: Path,
) -> str | None:
    """The refusal of the first weight the model reads that the files lack, or hold in another shape
    than config.json implies or in a type not in WEIGHT_DTYPES; None when all agree. get_slice reads a
    header's shape and type, no data."""
    for name, expected in expected_weights(text_model_shape(config)).items():
        key = layout.checkpoint_name(name)
        if key not in file_of:
            return f"weight {key} not found in the checkpoint in {model_dir}"
        stored = file_of[key].get_slice(key)
        refusal = mismatch(key, tuple(stored.get_shape()), expected, "config.json")
        if refusal is not None:
            return f"{path_of[key]}: {refusal}"
        refusal = type_refusal(key, stored.get_dtype())
        if refusal is not None:
            return f"{path_of[key]}: {refusal}"
    return None


# The weights transformers loads these architectures without and never reports: older files hold each
# RoPE's inverse frequencies (model.layers.N.self_attn.rotary_emb.inv_freq), a buffer every version
# recomputes. transformers 5.25 drops any key this pattern finds in a model with such a buffer
# (PreTrainedModel._adjust_missing_and_unexpected_keys; Llama, Qwen2, Qwen3 and Mistral hold
# model.rotary_emb.inv_freq and set no _keys_to_ignore_on_load_unexpected of their own).
IGNORED_UNREAD = re.compile(r"rotary_emb\.inv_freq")
MAX_NAMED_UNREAD = 3  # the warning on weights the model does not read names this many, then counts
_HEAD_ROWS_PER_READ = 4096  # the tied head's comparison reads this many rows of each table at a time


def check_unread(
    file_of: dict[str, Any],  # checkpoint name -> the open safetensors file holding it
    path_of: dict[str, Path],  # checkpoint name -> that file's path
    stamp_of: dict[Path, FileStamp],  # each file's path -> its stamp read just before it was opened
    layout: WeightLayout,
    config: ModelConfig,
    error: Callable[[str], Exception],
) -> list[str]:
    """The warnings (at most two lines) on the language model's weights that the model does not read;
    raises `error(message)` for one the config's architecture would read were a flag the other way.
    A vision-language checkpoint's tower and projector are the encoder's, not looked at here."""
    shape = text_model_shape(config)
    expected = {layout.checkpoint_name(name) for name in expected_weights(shape)}
    flagged = {layout.checkpoint_name(name): flag for name, flag in flagged_weights(shape).items()}
    warnings = []
    for key, flag in flagged.items():
        if key not in file_of:
            continue
        if flag != "is_tied":
            raise error(
                f"{path_of[key]}: weight {key} is in the file, but {_source(layout)} says "
                f"{_setting(flag, config, layout)}: the model would serve without it"
            )
        table = layout.checkpoint_name("model.embed_tokens.weight")
        if not _is_same_table(file_of, path_of, stamp_of, key, table):
            raise error(
                f"{path_of[key]}: weight {key} differs from {table}, but config.json says "
                "tie_word_embeddings true: the head would read the token table, not this weight"
            )
        warnings.append(
            f"{path_of[key]}: weight {key} is not read: config.json says tie_word_embeddings true, and it "
            f"equals {table}, which the head reads"
        )
    unread = [
        key
        for key in file_of
        if key not in expected
        and key not in flagged
        and _is_language_model(key, layout)
        and IGNORED_UNREAD.search(key) is None
    ]
    if unread:
        named = ", ".join(unread[:MAX_NAMED_UNREAD]) + (", ..." if len(unread) > MAX_NAMED_UNREAD else "")
        count = (
            "1 weight in the checkpoint is"
            if len(unread) == 1
            else f"{len(unread)} weights in the checkpoint are"
        )
        warnings.append(f"{count} not read by {config.architecture}: {named}")
    return warnings


def _is_language_model(key: str, layout: WeightLayout) -> bool:
    """Whether checkpoint weight `key` is the language model's: a plain causal LM's are all its own."""
    return layout == PLAIN or key.startswith(layout.model_prefix) or key == layout.head_name


def _source(layout: WeightLayout) -> str:
    """Where the keys the decoder reads are: a vision-language config.json nests its language model's."""
    return "config.json" if layout == PLAIN else "config.json's text_config"


def _setting(flag: str, config: ModelConfig, layout: WeightLayout) -> str:
    """The config.json setting that leaves the weights of TextModelShape field `flag` out of the model."""
    key = {"has_qkv_bias": "attention_bias", "has_o_bias": "attention_bias", "has_mlp_bias": "mlp_bias"}
    # Llama's and Qwen3's biases follow their keys (models/config.py); Qwen2's and Mistral's, and whether
    # the layer has q_norm and k_norm, follow the architecture alone.
    if flag in key and config.architecture in ("LlamaForCausalLM", "Qwen3ForCausalLM"):
        return f"{key[flag]} false"
    if layout == PLAIN:
        return f"architectures {config.architecture}, which has no such weight"
    model_type = {arch: name for name, arch in TEXT_ARCHITECTURES.items()}[config.architecture]
    return f"model_type {model_type}, whose {config.architecture} has no such weight"


@dataclass(frozen=True)
class FileStamp:
    """A file as it is now: the same path written anew is another stamp (its size, its times or, where
    it was replaced, its inode differ)."""

    path: Path  # resolved
    device: int
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @staticmethod
    def of(path: Path) -> FileStamp:
        # Resolved first and the file resolved to stated: stating `path` and resolving it apart, a
        # symlink retargeted between the two gave one file's path with another's numbers.
        resolved = path.resolve()
        st = resolved.stat()
        return FileStamp(resolved, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


# Whether a tied head equals its token table, by (head's file, head's key, table's file, table's key).
# A decoder compares before it listens (check_checkpoint) and its load checks the same files again, as
# each rank's does (0.69 s each for Qwen2.5-0.5B's 151,936 x 896 bf16 pair); the verdict depends on the
# files' bytes alone, so a process compares a given pair once and a file written since, again.
_same_tables: dict[tuple[FileStamp, str, FileStamp, str], bool] = {}


def _is_same_table(
    file_of: dict[str, Any],
    path_of: dict[str, Path],
    stamp_of: dict[Path, FileStamp],
    key: str,
    table: str,
) -> bool:
    """Whether head `key` equals token table `table`, compared once per process and pair of files.

    NOTE: a verdict is about the bytes of the files open in `file_of`, which need not be what their
    paths hold now: a file replaced (or written in place) after it was opened leaves the open file's
    bytes under a path that stats as the new one. So a verdict is filed under the stamps read before
    the files were opened, and only where each path stats the same after the comparison (no change
    from before the open to the end of the comparison: the bytes compared are that stamp's); a verdict
    on file is used only where the same holds now, else the open files are compared again. Each file
    is opened by the path its stamp resolved (FileStamp.path), so a symlinked path retargeted before
    the open and back before the second stat cannot have another file judged under the stamp."""
    paths = (path_of[key], path_of[table])
    memo = (stamp_of[paths[0]], key, stamp_of[paths[1]], table)

    def unchanged() -> bool:
        try:
            return all(FileStamp.of(path) == stamp_of[path] for path in paths)
        except OSError:  # removed since it was opened: the open file is still compared, not filed
            return False

    if memo in _same_tables and unchanged():
        return _same_tables[memo]
    same = _same_table(file_of[key], key, file_of[table], table)
    if unchanged():
        _same_tables[memo] = same
    return same


def _same_table(head: Any, head_key: str, table: Any, table_key: str) -> bool:
    """Whether two tensors of the open safetensors files hold the same values, read a block of rows at a
    time (the tables are the checkpoint's largest), stopping at the first that differs."""
    head_rows, table_rows = head.get_slice(head_key), table.get_slice(table_key)
    shape = head_rows.get_shape()
    if shape != table_rows.get_shape():
        return False
    # One dtype: the bytes first (a NaN equals itself: it is refused while loading, naming its element),
    # then, for a block whose bytes differ, the values (-0.0 and 0.0 are one value, as they are across
    # dtypes); two dtypes: the values, as float64 holds every value of the others.
    same_dtype = head_rows.get_dtype() == table_rows.get_dtype()
    for start in range(0, shape[0], _HEAD_ROWS_PER_READ):
        rows = slice(start, start + _HEAD_ROWS_PER_READ)
        head_block, table_block = head_rows[rows], table_rows[rows]
        if same_dtype and torch.equal(head_block.view(torch.uint8), table_block.view(torch.uint8)):
            continue
        if not torch.equal(head_block.double(), table_block.double()):
            return False
    return True
