"""The context cap: the configured max_model_len, never past the checkpoint's positions, nor past what
the KV pool holds for one sequence (its blocks less the reserved null block)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from tandem.decoder.config import EngineConfig
from tandem.decoder.engine.step.sizing import max_model_len


def test_the_context_is_the_least_of_the_flag_the_checkpoint_and_the_pool() -> None:
    model = SimpleNamespace(max_position_embeddings=4096)
    config = EngineConfig(model_dir=Path("m"), block_size=16)
    assert max_model_len(config, model) == 4096  # type: ignore[arg-type]
    assert max_model_len(config, model, num_blocks=1000) == 4096  # type: ignore[arg-type]
    assert max_model_len(config, model, num_blocks=40) == 39 * 16  # type: ignore[arg-type]
    shorter = EngineConfig(model_dir=Path("m"), block_size=16, max_model_len=100)
    assert max_model_len(shorter, model, num_blocks=40) == 100  # type: ignore[arg-type]
    assert max_model_len(config, model, num_blocks=2) == 16  # type: ignore[arg-type]
