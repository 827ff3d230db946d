"""--num-kv-blocks and --kv-cache-bytes are bounded by what a pool may address (MAX_KV_SLOTS: the slots
the step broadcast carries are int32), and --block-size by two blocks of it: past it each is one line
naming the flag and the limit, exit 2, before any weight is read. --num-kv-blocks 10**12 set up a block
table of 10**12 Python objects before its pool was asked for, and --kv-cache-bytes 10**20 derived as
many blocks."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tandem.client.errors import ConfigError
from tandem.decoder.api.main import config_from_args
from tandem.decoder.api.main import main as decoder_main
from tandem.decoder.config import MAX_BLOCK_SIZE, MAX_KV_SLOTS, EngineConfig
from tandem.decoder.engine.step.sizing import num_kv_blocks

BLOCKS = "tandem serve decoder: --num-kv-blocks (TANDEM_NUM_KV_BLOCKS)"
BYTES = "tandem serve decoder: --kv-cache-bytes (TANDEM_KV_CACHE_BYTES)"


@pytest.mark.parametrize("block_size", [16, 32])
def test_the_most_blocks_a_pool_may_hold_are_int32_slots_of_the_block_size(block_size: int) -> None:
    most = MAX_KV_SLOTS // block_size
    flags = ["--block-size", str(block_size), "--num-kv-blocks"]
    assert config_from_args([*flags, str(most)]).engine.num_kv_blocks == most
    with pytest.raises(ConfigError) as refused:
        config_from_args([*flags, str(most + 1)])
    assert refused.value.field == "num_kv_blocks"


def test_a_block_count_past_the_limit_is_one_line_naming_the_flag_and_the_limit(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert decoder_main(["--num-kv-blocks", str(10**12), "--port", "0"]) == 2
    assert capsys.readouterr().err == (
        f"{BLOCKS} must be at most 134,217,728 (2,147,483,648 KV slots, int32's, of --block-size 16), "
        "got 1,000,000,000,000\n"
    )


def test_a_pool_size_past_the_limit_for_the_model_is_one_line_before_anything_loads(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str], environ
) -> None:
    assert decoder_main(["--model", str(tiny_model_dir), "--kv-cache-bytes", str(10**20), "--port", "0"]) == 2
    said = capsys.readouterr().err
    assert said.startswith(f"{BYTES} must be at most "), said
    assert " for this model (a byte less than 134,217,728 blocks of " in said, said
    assert said.endswith(
        " bytes on each rank, which buys 134,217,727 blocks and the reserved one: 2,147,483,648 KV slots, "
        "int32's, of --block-size 16), got 100,000,000,000,000,000,000\n"
    ), said


@pytest.mark.parametrize("block_size", [16, MAX_BLOCK_SIZE])
def test_the_most_pool_bytes_are_exact_a_byte_more_is_refused_naming_that_figure(block_size: int) -> None:
    """The bytes buy a block per whole block's bytes beside the reserved one: the most a pool may hold is
    reached at a byte less than max_kv_blocks blocks' bytes, not at max_kv_blocks - 1 blocks'."""
    model = SimpleNamespace(num_kv_heads=2, num_layers=3, head_dim=4, dtype=torch.float16)
    per_block = 2 * 3 * block_size * 2 * 4 * 2
    most_blocks = MAX_KV_SLOTS // block_size
    most = most_blocks * per_block - 1

    def blocks(kv_cache_bytes: int) -> int:
        config = EngineConfig(model_dir=Path("m"), block_size=block_size, kv_cache_bytes=kv_cache_bytes)
        return num_kv_blocks(config, model, world_size=1)  # type: ignore[arg-type]

    assert blocks(most) == most_blocks
    with pytest.raises(ConfigError) as refused:
        blocks(most + 1)
    assert refused.value.reason.startswith(f"must be at most {most:,} for this model ("), refused.value.reason


def test_a_block_size_past_two_blocks_of_the_slots_is_one_line_naming_the_flag_and_the_limit(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--block-size 2**32 said '--num-kv-blocks must be at most 0' and 3 * 10**9 a negative
    --kv-cache-bytes limit: past MAX_BLOCK_SIZE no pool of two blocks is addressable."""
    assert config_from_args(["--block-size", str(MAX_BLOCK_SIZE)]).engine.max_kv_blocks == 2
    for block_size in (MAX_BLOCK_SIZE + 1, 3 * 10**9, 2**32):
        assert decoder_main(["--block-size", str(block_size), "--num-kv-blocks", "2", "--port", "0"]) == 2
        assert capsys.readouterr().err == (
            "tandem serve decoder: --block-size (TANDEM_BLOCK_SIZE) must be at most 1,073,741,824 (two "
            "blocks, the reserved one and one to use, within 2,147,483,648 KV slots, int32's), "
            f"got {block_size:,}\n"
        )


def test_a_block_size_the_backends_attention_cannot_tile_is_one_line_naming_the_flag(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """FlexAttention (cuda) tiles keys by the cache's block: a size it cannot take was a ValueError's
    traceback at start; it is the flag's one line, exit 2, before a device or weight is touched."""
    assert decoder_main(["--device", "cuda", "--block-size", "8", "--port", "0"]) == 2
    assert capsys.readouterr().err == (
        "tandem serve decoder: --block-size (TANDEM_BLOCK_SIZE) must be a power of two >= 16 for "
        "FlexAttention (cuda), got 8\n"
    )
