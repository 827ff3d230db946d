"""Quantized weights on the XLA device (`--quantization int8 | int4` with `--device neuron`): rounded
on the host exactly as the CPU engine rounds them, held on the device as the same codes, scales and
offsets, and dequantized inside each step's graph (models/quantized.py's reference forward). The CPU
engine's tokens for token and embedding prompts, not one graph compiled after warmup, and the codes
on the device, never a dense copy."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem.common.torch_part.prompt_parts import EmbeddingPrompt
from tandem.decoder.backends.xla import runtime
from tandem.decoder.engine.step.xla_runner import XlaRunner
from tandem.decoder.models.quantized import QuantizedEmbedding, QuantizedLinear
from tests.xla.helpers import engine_on, greedy, settings, table_rows


@pytest.mark.parametrize(
    "quantization", [dict(quantization="int8"), dict(quantization="int4", quantization_group_size=64)]
)
def test_quantized_weights_give_the_cpu_engines_tokens_and_compile_nothing_after_warmup(
    tiny_model_dir: Path, quantization: dict[str, object]
) -> None:
    values = settings(tiny_model_dir, **quantization)
    with engine_on("cpu", **values) as cpu:
        vocab = cpu.model_config.vocab_size
        ids = [[(7 * i + 3) % (vocab - 2) + 1 for i in range(n)] for n in (3, 11, 20)]
        rows = table_rows(tiny_model_dir, ids[1], seed=1)
        prompts = [[p] for p in ids] + [[EmbeddingPrompt(rows)], [ids[0], EmbeddingPrompt(rows[:4])]]
        want = [greedy(cpu, prompt, num_tokens=12) for prompt in prompts]
    with engine_on("neuron", **values) as xla:
        runner = xla.core.runner
        assert isinstance(runner, XlaRunner)
        model = xla.loaded.model
        quantized = [m for m in model.modules() if isinstance(m, QuantizedLinear | QuantizedEmbedding)]
        assert quantized and all(m.qweight.codes.device.type == "xla" for m in quantized)
        assert not any(
            p.dim() == 2 and p.dtype.is_floating_point for p in model.parameters()
        )  # no dense matrix left: norms and biases only
        compiled = runtime.num_compiles()
        got = [greedy(xla, prompt, num_tokens=12) for prompt in prompts]
        assert runtime.num_compiles() == compiled and runner.num_compiles_after_warmup == 0
    assert got == want


def test_the_codes_on_the_device_are_the_cpu_engines(tiny_model_dir: Path) -> None:
    values = settings(tiny_model_dir, quantization="int4")
    with engine_on("cpu", **values) as cpu:
        host = {n: m.qweight for n, m in cpu.loaded.model.named_modules() if isinstance(m, QuantizedLinear)}
    with engine_on("neuron", **values) as xla:
        device = {n: m.qweight for n, m in xla.loaded.model.named_modules() if isinstance(m, QuantizedLinear)}
        assert host.keys() == device.keys()
        for name, weight in device.items():
            assert torch.equal(weight.codes.cpu(), host[name].codes), name
            assert torch.equal(weight.scales.cpu(), host[name].scales), name
