"""The context cap: the configured max_model_len, never past the checkpoint's positions, nor past what
the KV pool holds for one sequence (its blocks less the reserved null block); and a sliding window no
narrower than that context."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from tandem.client.errors import ConfigError
from tandem.decoder.config import EngineConfig
from tandem.decoder.engine.step.sizing import check_sliding_window, max_model_len
from tandem.decoder.models.config import SlidingWindow


def test_the_context_is_the_least_of_the_flag_the_checkpoint_and_the_pool() -> None:
    model = SimpleNamespace(max_position_embeddings=4096)
    config = EngineConfig(model_dir=Path("m"), block_size=16)
    assert max_model_len(config, model) == 4096  # type: ignore[arg-type]
    assert max_model_len(config, model, num_blocks=1000) == 4096  # type: ignore[arg-type]
    assert max_model_len(config, model, num_blocks=40) == 39 * 16  # type: ignore[arg-type]
    shorter = EngineConfig(model_dir=Path("m"), block_size=16, max_model_len=100)
    assert max_model_len(shorter, model, num_blocks=40) == 100  # type: ignore[arg-type]
    assert max_model_len(config, model, num_blocks=2) == 16  # type: ignore[arg-type]


def test_a_sliding_window_as_wide_as_the_context_served_is_served() -> None:
    """Every query then sees every key before it, as the window would let it: full attention is exact."""
    v01 = SimpleNamespace(
        max_position_embeddings=32768, sliding_window=SlidingWindow(4096, "sliding_window 4096")
    )
    for flag in (4096, 100):
        check_sliding_window(EngineConfig(model_dir=Path("m"), max_model_len=flag), v01)  # type: ignore[arg-type]
    v03 = SimpleNamespace(max_position_embeddings=32768, sliding_window=None)
    check_sliding_window(EngineConfig(model_dir=Path("m")), v03)  # type: ignore[arg-type]


def test_a_sliding_window_narrower_than_the_context_is_refused_naming_the_flag_and_the_window() -> None:
    """Mistral v0.1: 4,096 keys per query beside 32,768 positions. Served with full attention, prompts past
    the window would get other answers than the model's, and nothing would say so."""
    v01 = SimpleNamespace(
        max_position_embeddings=32768, sliding_window=SlidingWindow(4096, "sliding_window 4096")
    )
    with pytest.raises(ConfigError) as unset:
        check_sliding_window(EngineConfig(model_dir=Path("m")), v01)  # type: ignore[arg-type]
    assert unset.value.field == "max_model_len"
    assert unset.value.reason == (
        "must be at most 4096 to serve this checkpoint, got 32768 (config.json's max_position_embeddings): "
        "config.json's sliding_window 4096 narrows what each query attends to, and this decoder attends "
        "to the whole context (sliding-window attention is not implemented)"
    )
    with pytest.raises(ConfigError, match=r"^max_model_len must be at most 4096 .*, got 4097: "):
        check_sliding_window(EngineConfig(model_dir=Path("m"), max_model_len=4097), v01)  # type: ignore[arg-type]
