"""A LoRA adapter in PEFT's format, read without peft: `adapter_config.json` + `adapter_model.safetensors`.

Only safetensors is read (never `adapter_model.bin`: a pickle). Every rule is checked before
anything is kept, so a refused adapter leaves nothing behind, and each refusal names the file and
the field at fault. The rules are what the serving side can honour exactly: plain LoRA (no DoRA, no
bias terms, no `modules_to_save`, no per-module rank or alpha patterns) on the attention and MLP
projections (q/k/v/o, gate/up/down), rank at most --max-lora-rank, and every tensor of the shape
the base model's own projection has (so an adapter made for another base model, whose hidden size
or head counts differ, fails naming the first tensor that does not fit).

Scaling is PEFT's: lora_alpha / r, or lora_alpha / sqrt(r) with `use_rslora`. Which settings of
adapter_config.json are honoured, and which tensors peft would load by them: peft_config.py. The
tensors, checked against the base model and those settings: peft_weights.py. How each file is read
(whole, from one descriptor, never mapped, never followed out of --lora-root): adapter_files.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.common.checkpoint import MAX_JSON_BYTES, json_object
from tandem.decoder.models.adapter_error import AdapterError
from tandem.decoder.models.adapter_files import NOT_A_DIRECTORY, FoundAdapter, read_file
from tandem.decoder.models.beneath import MAX_PATH_BYTES, open_beneath
from tandem.decoder.models.config import ModelConfig
from tandem.decoder.models.peft_config import CONFIG_FILE, TARGETS, check_config
from tandem.decoder.models.peft_weights import WEIGHTS_FILE, check_absent, max_weights_bytes, read_weights

PICKLE_FILE = "adapter_model.bin"


@dataclass(frozen=True)
class LoraAdapter:
    """An adapter's weights, checked against one base model; not yet in any slot."""

    rank: int  # r
    scale: float  # lora_alpha / r (rsLoRA: / sqrt(r))
    targets: tuple[str, ...]  # the checkpoint modules it adapts, in TARGETS order
    # (layer, module) -> (A [rank, in_features], B [out_features, rank]), float32
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def num_parameters(self) -> int:
        return sum(a.numel() + b.numel() for a, b in self.weights.values())


def read_adapter(
    path: str | Path,
    config: ModelConfig,
    max_rank: int,
    shown: str | None = None,
    found: FoundAdapter | None = None,
) -> LoraAdapter:
    """The adapter in directory `path`, checked against a base model of `config`. Raises AdapterError.
    `shown`: the directory as refusals name it, `path` by default (a LoadAdapter caller under
    --lora-root sees the path it named relative to the root, never the server's own).
    `found` None: `path` is the operator's (--lora), followed wherever it leads. Otherwise `path` (only
    checked and logged) was resolved inside --lora-root as `found`, and the read opens what `found` says
    from the root's descriptor: a symlink standing on its path now, or a file other than the one found,
    was swapped in since by a writer of the root and may lead out, so it is refused, never followed."""
    if not str(path):
        raise AdapterError("path", "must not be empty (it would name the server's working directory)")
    # The operator's path only: a caller's was checked as it was sent (AdapterRoot.find), and the one it
    # resolved to is opened by its parts, from the root's descriptor, whatever its length with the root's
    # (which is no caller's business) and its bytes (a name in no encoding, as fsencode keeps it).
    if found is None and (num_bytes := len(os.fsencode(path))) > MAX_PATH_BYTES:
        raise AdapterError("path", f"must be at most {MAX_PATH_BYTES} bytes, got {num_bytes}")
    shown = str(path) if shown is None else shown
    try:
        if found is None:
            directory = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        else:
            directory = open_beneath(found.root.fd, found.directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as error:
        if error.errno in NOT_A_DIRECTORY:
            raise AdapterError(
                "path", f"{shown} is not a directory ({CONFIG_FILE} + {WEIGHTS_FILE})"
            ) from None
        # A name over NAME_MAX, a directory that cannot be listed...
        raise AdapterError("path", f"cannot be read: {error.strerror}") from None
    try:
        return _read_directory(directory, config, max_rank, shown, found)
    finally:
        os.close(directory)


def _read_directory(
    directory: int, config: ModelConfig, max_rank: int, shown: str, found: FoundAdapter | None
) -> LoraAdapter:
    """read_adapter's work, every file opened relative to the open `directory`."""
    config_bytes = read_file(
        directory, CONFIG_FILE, shown, found, MAX_JSON_BYTES, "a JSON file of a checkpoint may"
    )
    if config_bytes is None:
        raise _ConfigFileError(f"{CONFIG_FILE} not found in {shown}")
    settings = check_config(
        json_object(config_bytes, f"{shown}/{CONFIG_FILE}", _ConfigFileError),
        max_rank,
        config.num_layers,
        has_qk_norm=config.has_qk_norm,
    )
    rank = settings.rank
    max_bytes = max_weights_bytes(config, rank)
    weights_bytes = read_file(
        directory,
        WEIGHTS_FILE,
        shown,
        found,
        max_bytes,
        f"an adapter of r {rank} for this base model can hold",
    )
    if weights_bytes is None:
        try:  # the name itself, inside the directory: a symlink is not followed (it may lead anywhere)
            os.stat(PICKLE_FILE, dir_fd=directory, follow_symlinks=False)
            hint = f" ({PICKLE_FILE} is a pickle, never read: save it as safetensors)"
        except OSError:
            hint = ""
        raise AdapterError(WEIGHTS_FILE, f"not found in {shown}{hint}")
    weights = read_weights(weights_bytes, config, settings)
    check_absent(weights, config, settings, shown)
    targets = tuple(t for t in TARGETS if any(module == t for _, module in weights))
    return LoraAdapter(rank=rank, scale=settings.scale, targets=targets, weights=weights)


class _ConfigFileError(AdapterError):
    """adapter_config.json missing or not a JSON object."""

    def __init__(self, message: str) -> None:
        super().__init__(CONFIG_FILE, message)
