"""Quantized weights on several XLA devices (`--quantization int8 | int4 --device neuron --world-size
2`): the codes, scales and offsets split over the devices as the dense weights are
(backends/xla/sharding.py: output rows in whole groups of 16, inputs in whole blocks of 32), each still
dequantized inside the graph that multiplies it. Each device holds what models/quantized_shards.py's
`cut` gives a rank of the one-device weight; the engine gives the CPU engine's greedy tokens for token,
embedding and mixed prompts, all in one decode batch, and compiles nothing after warmup.

Several devices need a process of their own (this one's XLA runtime spans one: conftest.py): it
serves each quantization in turn and prints what it saw as one JSON line. On three devices most of the
tiny model's weights do not divide into whole groups or blocks: those are held whole on each device.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from tandem.common.torch_part.quantized_tensor import QuantizedTensor
from tandem.decoder.engine.step.xla_runner import XlaRunner
from tandem.decoder.models.loader import load_model
from tandem.decoder.models.quantized import QuantizedEmbedding, QuantizedLinear
from tandem.decoder.models.quantized_shards import cut
from tandem.decoder.models.transformer import DecoderModel
from tests.xla.helpers import engine_on, prompts_of_each_kind
from tests.xla.test_server import BUCKETS, LIMITS, _cpu_tokens, greedy_at_once

NUM_DEVICES = 2
QUANTIZATIONS: dict[str, dict[str, object]] = {
    "int8": dict(quantization="int8"),
    "int4": dict(quantization="int4", quantization_group_size=64),  # a group spans a device's 32 inputs
}
# The dimension each quantized weight is split along, as the dense weights: output rows (column-parallel
# projections, the token table) or inputs (row-parallel projections).
SPLIT_DIM = {"qkv_proj": 0, "gate_up_proj": 0, "embed_tokens": 0, "o_proj": 1, "down_proj": 1}


def _prompts(model_dir: Path) -> list[list]:
    kinds = prompts_of_each_kind(model_dir, 1024, count=2)  # the same in both processes: seeded
    return [p for kind in kinds.values() for p in kind]  # token, embedding and mixed: 3 and 7 positions


def _held(model: DecoderModel, host: DecoderModel, num_devices: int) -> dict[str, str]:
    """Each quantized weight of `model` (sharded over the devices) by name -> "cut" where each device
    holds exactly the codes, scales and offsets `cut` gives that rank of `host`'s (the same weights on
    the host), "whole" where each holds all of host's, else "neither"."""
    import torch_xla

    on_host = dict(host.named_modules())
    held_as: dict[str, str] = {}
    for name, module in model.named_modules():
        if not isinstance(module, QuantizedLinear | QuantizedEmbedding):
            continue
        whole = on_host[name].qweight
        fields = ["codes", "scales"] + ([] if whole.mins is None else ["mins"])
        held = {f: torch_xla._XLAC._get_local_shards([getattr(module.qweight, f)])[0] for f in fields}
        dim = SPLIT_DIM[name.rpartition(".")[2]]
        try:
            shares = [cut(whole, dim, rank, num_devices) for rank in range(num_devices)]
        except ValueError:  # a dimension that does not split into the devices' shares
            shares = None
        if shares is not None and _holds(held, shares):
            held_as[name] = "cut"
        else:
            held_as[name] = "whole" if _holds(held, [whole] * num_devices) else "neither"
    return held_as


def _holds(held: dict[str, list[tuple[torch.Tensor, str]]], shares: list[QuantizedTensor]) -> bool:
    """Whether device `rank` holds shares[rank]'s codes, scales and offsets (`held`: the local shards
    of each of those fields, in device order)."""
    return all(
        [device for _, device in held[f]] == [f"CPU:{rank}" for rank in range(len(shares))]
        and all(
            torch.equal(data.flatten(), getattr(shares[rank], f).flatten())
            for rank, (data, _) in enumerate(held[f])
        )
        for f in held
    )


def serve_on_devices(model_dir: str, num_devices: int, names: list[str]) -> None:
    """Run in a process of its own: for each quantization of `names`, the engine on `num_devices` XLA
    devices, and one JSON line of what it gave (tokens, graphs compiled after warmup, how each weight
    is held)."""
    seen: dict[str, dict[str, object]] = {}
    prompts = _prompts(Path(model_dir))
    for name in names:
        settings = QUANTIZATIONS[name]
        values = dict(model_dir=Path(model_dir), dtype="float32", num_kv_blocks=96, **LIMITS, **BUCKETS)
        with engine_on("neuron", num_devices=num_devices, **values, **settings) as xla:
            runner = xla.core.runner
            assert isinstance(runner, XlaRunner)
            group_size = settings.get("quantization_group_size", 32)
            host = load_model(model_dir, dtype="float32", quantization=name, group_size=group_size).model
            seen[name] = {
                "held": _held(xla.loaded.model, host, num_devices),
                "tokens": greedy_at_once(xla, prompts),
                "compiled_after_warmup": runner.num_compiles_after_warmup,
            }
    print(json.dumps(seen))


def _served(model_dir: Path, num_devices: int, names: list[str]) -> dict[str, dict[str, Any]]:
    """What serve_on_devices saw, in a process whose XLA runtime spans `num_devices` (this one's spans
    one: conftest.py)."""
    code = (
        "from tests.xla.test_quantized_devices import serve_on_devices as s; "
        f"s({str(model_dir)!r}, {num_devices}, {names!r})"
    )
    env = {k: v for k, v in os.environ.items() if k != "CPU_NUM_DEVICES"}  # the engine asks for its count
    root = Path(__file__).parents[2]
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@functools.cache
def _cpu_reference(model_dir: Path, name: str | None) -> list[list[int]]:
    """The CPU engine's tokens for the prompts, dense (None) or under QUANTIZATIONS[name]: computed once
    for all the tests of this module."""
    return _cpu_tokens(model_dir, _prompts(model_dir), **({} if name is None else QUANTIZATIONS[name]))


def test_two_devices_hold_the_cut_codes_give_the_cpu_engines_tokens_and_compile_nothing_after_warmup(
    tiny_model_dir: Path,
) -> None:
    seen = _served(tiny_model_dir, NUM_DEVICES, list(QUANTIZATIONS))
    dense = _cpu_reference(tiny_model_dir, None)
    for name in QUANTIZATIONS:
        want = _cpu_reference(tiny_model_dir, name)
        assert want != dense, name  # the rounding counts
        held = seen[name]["held"]
        assert len(held) == 17, name  # 4 layers of 4 projections, the token table
        assert set(held.values()) == {"cut"}, name
        assert seen[name]["compiled_after_warmup"] == 0, name
        assert seen[name]["tokens"] == want, name


def test_a_weight_whose_groups_or_blocks_do_not_divide_over_the_devices_is_held_whole_on_each(
    tiny_model_dir: Path,
) -> None:
    """Three devices: qkv_proj's 128 output rows are 8 groups of 16 and the token table's 1,024 rows
    64 groups, o_proj's 64 inputs 2 blocks of 32, none a multiple of 3: each device holds them whole,
    beside gate_up_proj's 24 groups and down_proj's 6 blocks, cut. The graphs multiply both kinds and
    give the CPU engine's tokens."""
    seen = _served(tiny_model_dir, 3, ["int8"])["int8"]
    layers = [f"layers.{i}" for i in range(4)]
    whole = [f"{layer}.self_attn.{p}" for layer in layers for p in ("qkv_proj", "o_proj")]
    split = [f"{layer}.mlp.{p}" for layer in layers for p in ("gate_up_proj", "down_proj")]
    assert seen["held"] == {"embed_tokens": "whole"} | dict.fromkeys(whole, "whole") | dict.fromkeys(
        split, "cut"
    )
    assert seen["compiled_after_warmup"] == 0
    assert seen["tokens"] == _cpu_reference(tiny_model_dir, "int8")
