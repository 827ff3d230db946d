"""The engine on CUDA against the same engine on CPU (run by scripts/device_check.sh; skipped here)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.decoder.config import EngineConfig
from services.decoder.engine.engine import Engine
from services.decoder.engine.outputs import Delta
from services.decoder.engine.params import SamplingParams, StoppingParams
from services.decoder.engine.prompt import EmbeddingPrompt, GenerateSpec

pytestmark = pytest.mark.gpu


def _specs(hidden_size: int) -> list[GenerateSpec]:
    gen = torch.Generator().manual_seed(0)
    stopping = StoppingParams(max_new_tokens=16, ignore_eos=True)
    greedy = SamplingParams(temperature=0.0)
    return [
        GenerateSpec([[11, 12, 13, 14, 15, 16, 17]], greedy, stopping),
        GenerateSpec(
            [[21, 22], EmbeddingPrompt(torch.randn(3, hidden_size, generator=gen)), [23]], greedy, stopping
        ),
    ]


def _tokens(model_dir: Path, **overrides) -> list[list[int]]:
    settings = dict(model_dir=model_dir, dtype="float32", num_kv_blocks=256, block_size=16, max_num_seqs=4)
    settings.update(overrides)
    with Engine(EngineConfig(**settings)) as engine:
        specs = _specs(engine.model_config.hidden_size)
        return [[t for e in engine.generate(s) if isinstance(e, Delta) for t in e.token_ids] for s in specs]


def test_cuda_engine_gives_the_cpu_tokens_in_float32(tiny_model_dir: Path) -> None:
    assert _tokens(tiny_model_dir, device="cuda") == _tokens(tiny_model_dir)


def test_cuda_graph_decode_buckets_give_the_eager_cuda_tokens(tiny_model_dir: Path) -> None:
    static = dict(static_shapes=True, max_num_batched_tokens=64, max_model_len=256)
    eager = _tokens(tiny_model_dir, device="cuda", **static)
    compiled = _tokens(tiny_model_dir, device="cuda", compile=True, **static)
    assert compiled == eager
