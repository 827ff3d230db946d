"""Reading one part of a checkpoint: the tensors under a name prefix, from whichever shards hold them
(which file holds which name is tandem.common.torch_part.weight_files').

The encoder loads a vision-language checkpoint's tower and projector and never its language model's
layers: only the names asked for are read (safetensors files are memory-mapped).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open


def read_weights(files: dict[str, Path], names: Iterable[str]) -> dict[str, torch.Tensor]:
    """The named tensors (each must be in `files`, as tandem.common.torch_part.weight_files.weight_names
    returns it)."""
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
