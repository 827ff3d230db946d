"""The context cap: the configured max_model_len, never past the checkpoint's positions, nor past what
the KV pool holds for one sequence (its blocks less the reserved null block); a sliding window no
narrower than that context; and a step's token budget no larger than the positions the pool holds,
unless it is the default's."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from tandem.client.errors import ConfigError
from tandem.decoder.api.main import main as decoder_main
from tandem.decoder.config import EngineConfig
from tandem.decoder.engine.step.sizing import (
    DEFAULT_TOKEN_BUDGET,
    check_sliding_window,
    max_model_len,
    max_token_budget,
    num_kv_blocks,
)
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


# 1,024 bytes of K and V per position: 2 x 4 layers x 2 KV heads x 16 dims x 4 bytes (the tiny checkpoint's).
TINY = SimpleNamespace(num_kv_heads=2, num_layers=4, head_dim=16, dtype=SimpleNamespace(itemsize=4))


def test_a_token_budget_the_pool_holds_is_served() -> None:
    config = EngineConfig(model_dir=Path("m"), num_kv_blocks=1001, max_num_batched_tokens=16_000)
    assert num_kv_blocks(config, TINY, world_size=1) == 1001  # type: ignore[arg-type]


@pytest.mark.parametrize("budget", [16_001, 1_000_000, 2**63])
def test_a_token_budget_past_the_positions_the_pool_holds_is_refused_naming_the_pool(budget: int) -> None:
    """No step fills it (each position it computes takes a KV slot), yet static shapes warm a bucket
    past it: 2**63 walked power-of-two buckets up to 2**64 and never finished starting."""
    config = EngineConfig(model_dir=Path("m"), num_kv_blocks=1001, max_num_batched_tokens=budget)
    with pytest.raises(ConfigError) as error:
        num_kv_blocks(config, TINY, world_size=1)  # type: ignore[arg-type]
    assert error.value.field == "max_num_batched_tokens"
    assert error.value.reason == (
        "must be at most 16,000 (the positions the KV pool holds: 1,000 blocks of 16 beside the reserved "
        f"one, each position a step computes taking one; never under the default 2,048), got {budget:,}"
    )


def test_a_pool_sized_in_bytes_bounds_the_budget_as_one_sized_in_blocks() -> None:
    config = EngineConfig(model_dir=Path("m"), kv_cache_bytes=1024 * 16 * 200, max_num_batched_tokens=2**63)
    refusal = r"^max_num_batched_tokens must be at most 3,200 \(.*: 200 blocks of 16 "
    with pytest.raises(ConfigError, match=refusal):
        num_kv_blocks(config, TINY, world_size=1)  # type: ignore[arg-type]


@pytest.mark.parametrize("budget", [None, 2048])
def test_the_default_budget_stays_valid_beside_a_pool_smaller_than_it(budget: int | None) -> None:
    given = {} if budget is None else {"max_num_batched_tokens": budget}
    config = EngineConfig(model_dir=Path("m"), num_kv_blocks=8, **given)
    assert num_kv_blocks(config, TINY, world_size=1) == 8  # type: ignore[arg-type]


def test_the_most_budget_is_the_pools_positions_beside_the_reserved_block_never_under_the_default() -> None:
    """The bound the refusal above applies, which bench/decode_throughput.py caps its budget by."""
    assert max_token_budget(16, 1001) == 16_000
    assert max_token_budget(16, 8) == DEFAULT_TOKEN_BUDGET


@pytest.mark.parametrize("static_shapes", ["true", "false"])
def test_the_decoder_refuses_it_before_listening_in_one_line_naming_the_flag(
    tiny_model_dir: Path, static_shapes: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--model", str(tiny_model_dir), "--port", "0", "--static-shapes", static_shapes]
    assert decoder_main([*argv, "--num-kv-blocks", "65", "--max-num-batched-tokens", str(2**63)]) == 2
    assert capsys.readouterr().err == (
        "tandem serve decoder: --max-num-batched-tokens (TANDEM_MAX_NUM_BATCHED_TOKENS) must be at most "
        "2,048 (the positions the KV pool holds: 64 blocks of 16 beside the reserved one, each position a "
        "step computes taking one; never under the default 2,048), got 9,223,372,036,854,775,808\n"
    )
