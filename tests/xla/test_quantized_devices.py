"""Quantized weights on several XLA devices (`--quantization int8 | int4 --device neuron --world-size
2`): the codes, scales and offsets split over the devices as the dense weights are
(backends/xla/sharding.py: output rows in whole groups of 16, inputs in whole blocks of 32), each still
dequantized inside the graph that multiplies it. Each device holds what models/quantized_shards.py's
`cut` gives a rank of the one-device weight; the engine gives the CPU engine's greedy tokens for token,
embedding and mixed prompts, all in one decode batch, and compiles nothing after warmup.

Two devices need a process of their own (this one's XLA runtime spans one: conftest.py): it serves
int8, then int4, and prints what it saw as one JSON line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

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


def _num_cut_weights(model: DecoderModel, host: DecoderModel) -> int:
    """How many quantized weights of `model` (sharded over the devices) hold on each device exactly the
    codes, scales and offsets `cut` gives that rank of `host`'s (the same weights on the host)."""
    import torch_xla

    on_host = dict(host.named_modules())
    num_cut = 0
    for name, module in model.named_modules():
        if not isinstance(module, QuantizedLinear | QuantizedEmbedding):
            continue
        dim = SPLIT_DIM[name.rpartition(".")[2]]
        shares = [cut(on_host[name].qweight, dim, rank, NUM_DEVICES) for rank in range(NUM_DEVICES)]
        fields = ["codes", "scales"] + ([] if module.qweight.mins is None else ["mins"])
        held = {f: torch_xla._XLAC._get_local_shards([getattr(module.qweight, f)])[0] for f in fields}
        num_cut += all(
            [device for _, device in held[f]] == [f"CPU:{rank}" for rank in range(NUM_DEVICES)]
            and all(
                torch.equal(data.flatten(), getattr(shares[rank], f))
                for rank, (data, _) in enumerate(held[f])
            )
            for f in fields
        )
    return num_cut


def serve_on_two_devices(model_dir: str) -> None:
    """Run in a process of its own: for each quantization, the engine on two XLA devices, and one JSON
    line of what it gave (tokens, graphs compiled after warmup, weights held as `cut` gives them)."""
    seen: dict[str, dict[str, object]] = {}
    prompts = _prompts(Path(model_dir))
    for name, settings in QUANTIZATIONS.items():
        values = dict(model_dir=Path(model_dir), dtype="float32", num_kv_blocks=96, **LIMITS, **BUCKETS)
        with engine_on("neuron", num_devices=NUM_DEVICES, **values, **settings) as xla:
            runner = xla.core.runner
            assert isinstance(runner, XlaRunner)
            group_size = settings.get("quantization_group_size", 32)
            host = load_model(model_dir, dtype="float32", quantization=name, group_size=group_size).model
            seen[name] = {
                "num_quantized": sum(
                    isinstance(m, QuantizedLinear | QuantizedEmbedding) for m in host.modules()
                ),
                "num_cut": _num_cut_weights(xla.loaded.model, host),
                "tokens": greedy_at_once(xla, prompts),
                "compiled_after_warmup": runner.num_compiles_after_warmup,
            }
    print(json.dumps(seen))


def test_two_devices_hold_the_cut_codes_give_the_cpu_engines_tokens_and_compile_nothing_after_warmup(
    tiny_model_dir: Path,
) -> None:
    code = (
        f"from tests.xla.test_quantized_devices import serve_on_two_devices as s; s({str(tiny_model_dir)!r})"
    )
    env = {k: v for k, v in os.environ.items() if k != "CPU_NUM_DEVICES"}  # the engine asks for two
    root = Path(__file__).parents[2]
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    prompts = _prompts(tiny_model_dir)
    dense = _cpu_tokens(tiny_model_dir, prompts)
    for name, settings in QUANTIZATIONS.items():
        want = _cpu_tokens(tiny_model_dir, prompts, **settings)
        assert want != dense, name  # the rounding counts
        assert seen[name]["num_quantized"] == 17, name  # 4 layers of 4 projections, the token table
        assert seen[name]["num_cut"] == 17, name
        assert seen[name]["compiled_after_warmup"] == 0, name
        assert seen[name]["tokens"] == want, name
