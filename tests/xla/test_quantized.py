"""Quantized weights on the XLA device (`--quantization int8 | int4` with `--device neuron`): rounded
on the host exactly as the CPU engine rounds them, held on the device as the same codes, scales and
offsets, and dequantized inside each step's graph (models/quantized.py's reference forward). The CPU
engine's tokens for token and embedding prompts, not one graph compiled after warmup, and the codes
on the device, never a dense copy. `--quantization gguf` takes the same path: a GGUF file's blocks are
read on the host into the same three forms (4 bits without offsets, with offsets, 8 bits; any other
type re-quantized once to one of them), so each is dequantized in the graph as int8 and int4 are."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import gguf
import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from common.tests.common.gguf_files import gguf_name, mixed_types, write_gguf
from tandem.common.torch_part.gguf_import import import_gguf
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


@pytest.fixture(scope="module")
def gguf_model(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The tiny checkpoint as a GGUF file in each form the decoder serves (the writer the CPU tests use,
    fed from the checkpoint on disk: .venv-xla has no transformers): Q4_0 linears, a Q4_1 down_proj
    (offsets), a Q8_0 token table and a Q5_0 down_proj (re-quantized to 8 bits on reading), and the
    directory imported from it: (directory, file)."""
    root = tmp_path_factory.mktemp("gguf-xla")
    config = json.loads((tiny_model_dir / "config.json").read_text())
    config["rope_parameters"] = {"rope_theta": config["rope_theta"]}
    weights = {name: t.float() for name, t in load_file(tiny_model_dir / "model.safetensors").items()}
    model = SimpleNamespace(config=SimpleNamespace(**config), state_dict=lambda: weights)
    Q = gguf.GGMLQuantizationType
    types = {
        "model.layers.0.mlp.down_proj.weight": Q.Q4_1,
        "model.layers.1.mlp.down_proj.weight": Q.Q5_0,
        "model.embed_tokens.weight": Q.Q8_0,
    }
    raw = mixed_types(model, types)  # type: ignore[arg-type]
    assert set(raw) == {gguf_name(name) for name in types}
    tokenizer = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    path = write_gguf(root / "tiny.gguf", model, tokenizer, Q.Q4_0, raw_tensors=raw)
    return import_gguf(path, root / "imported", dtype="float32"), path


def test_a_gguf_files_own_blocks_give_the_cpu_engines_tokens_and_compile_nothing_after_warmup(
    gguf_model: tuple[Path, Path],
) -> None:
    model_dir, path = gguf_model
    values = settings(
        model_dir, quantization="gguf", quantized_from=path, seq_buckets=(4,), token_buckets=(32,)
    )
    with engine_on("cpu", **values) as cpu:
        vocab = cpu.model_config.vocab_size
        ids = [[(5 * i + 2) % (vocab - 2) + 1 for i in range(n)] for n in (3, 11, 20)]
        prompts = [[p] for p in ids] + [[EmbeddingPrompt(table_rows(model_dir, ids[1], seed=2))]]
        want = [greedy(cpu, prompt, num_tokens=12) for prompt in prompts]
    with engine_on("neuron", **values) as xla:
        runner = xla.core.runner
        assert isinstance(runner, XlaRunner)
        forms = {
            (m.qweight.bits, m.qweight.mins is not None)
            for m in xla.loaded.model.modules()
            if isinstance(m, QuantizedLinear | QuantizedEmbedding)
        }
        assert forms == {(4, False), (4, True), (8, False)}  # Q4_0, Q4_1; Q8_0 and Q5_0 as 8 bits
        compiled = runtime.num_compiles()
        got = [greedy(xla, prompt, num_tokens=12) for prompt in prompts]
        assert runtime.num_compiles() == compiled and runner.num_compiles_after_warmup == 0
    assert got == want
