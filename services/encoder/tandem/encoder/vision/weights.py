"""Reading one part of a checkpoint: the tensors under a name prefix, from whichever shards hold them.

The encoder loads a vision-language checkpoint's tower and projector and never its language model's
layers: only the names asked for are read (safetensors files are memory-mapped).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from tandem.common.checkpoint import read_json


def weight_names(model_dir: Path, error: Callable[[str], Exception]) -> dict[str, Path]:
    """Every weight name in the checkpoint -> the file that holds it."""
    index_path = model_dir / "model.safetensors.index.json"
    if index_path.is_file():
        weight_map = read_json(index_path, error).get("weight_map", {})
        return {name: model_dir / file for name, file in weight_map.items()}
    path = model_dir / "model.safetensors"
    if not path.is_file():
        raise error(f"model.safetensors (or model.safetensors.index.json) not found in {model_dir}")
    with safe_open(path, framework="pt", device="cpu") as weights:
        return dict.fromkeys(weights.keys(), path)


def read_weights(files: dict[str, Path], names: Iterable[str]) -> dict[str, torch.Tensor]:
    """The named tensors (each must be in `files`, as weight_names returns it)."""
    wanted: dict[Path, list[str]] = {}
    for name in names:
        wanted.setdefault(files[name], []).append(name)
    out = {}
    with ExitStack() as stack:
        for path, keys in wanted.items():
            handle = stack.enter_context(safe_open(path, framework="pt", device="cpu"))
            for key in keys:
                out[key] = handle.get_tensor(key)
    return out


def read_prefixed(
    files: dict[str, Path], prefixes: Iterable[str], error: Callable[[str], Exception]
) -> tuple[str, dict[str, torch.Tensor]]:
    """The first of `prefixes` that names any weight, and its tensors with the prefix taken off."""
    for prefix in prefixes:
        names = [name for name in files if name.startswith(prefix)]
        if names:
            tensors = read_weights(files, names)
            return prefix, {name.removeprefix(prefix): tensor for name, tensor in tensors.items()}
    raise error(f"no weights under any of {list(prefixes)} in the checkpoint")


def load_module(
    module: torch.nn.Module, state: dict[str, torch.Tensor], where: str, error: Callable[[str], Exception]
) -> None:
    """Assigns `state` to `module` (built on the meta device): every parameter present, shapes equal."""
    expected = dict(module.state_dict())
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise error(f"{where}: missing weights {missing[:5]}, unexpected {unexpected[:5]}")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise error(
                f"{where}{name} has shape {list(tensor.shape)}, expected {list(expected[name].shape)}"
            )
    module.load_state_dict(state, assign=True)
