"""A Qwen2 on two XLA devices: its q/k/v biases split over the devices with their rows (o_proj has
none), the streams carry the CPU engine's greedy tokens (which transformers' own Qwen2 gives too:
services/decoder/tests/models/test_models.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tandem.client.client import DecoderClient
from tests.xla.helpers import prompts_of_each_kind
from tests.xla.test_server import _cpu_tokens, _greedy_over_grpc, _wait_serving, serve_decoder


def _qwen2_of(tiny_model_dir: Path, out_dir: Path) -> Path:
    """The tiny Qwen3 made a Qwen2 (no .venv-xla transformers to write one): its q/k norms dropped,
    random q/k/v biases added (large enough to change the tokens), config.json's architecture changed."""
    model_dir = Path(shutil.copytree(tiny_model_dir, out_dir))
    weights = load_file(model_dir / "model.safetensors")
    generator = torch.Generator().manual_seed(0)
    for name in [n for n in weights if n.endswith(("q_norm.weight", "k_norm.weight"))]:
        del weights[name]
    for name in [n for n in weights if n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight"))]:
        rows = weights[name].shape[0]
        bias = torch.randn(rows, generator=generator) * 0.5
        weights[name.removesuffix("weight") + "bias"] = bias.to(weights[name].dtype)
    save_file(weights, model_dir / "model.safetensors")
    config = json.loads((model_dir / "config.json").read_text())
    config |= {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}
    (model_dir / "config.json").write_text(json.dumps(config))
    return model_dir


async def test_a_qwen2_on_two_devices_streams_the_cpu_engines_tokens(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    model_dir = _qwen2_of(tiny_model_dir, tmp_path / "qwen2")
    kinds = prompts_of_each_kind(model_dir, 1024, count=5)
    prompts = [p for kind in kinds.values() for p in kind]
    want = _cpu_tokens(model_dir, prompts)
    assert want != _cpu_tokens(tiny_model_dir, prompts)  # the biases count
    with serve_decoder(model_dir, 2) as (address, process):
        async with DecoderClient(address) as client:
            await _wait_serving(client, process)
            got = await _greedy_over_grpc(client, prompts)
    log = process.stdout.read() if process.stdout else ""
    assert "XLA: 0 graphs compiled after warmup" in log, log[-2000:]
    assert got == want
