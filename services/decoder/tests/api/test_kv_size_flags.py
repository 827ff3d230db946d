"""--num-kv-blocks and --kv-cache-bytes are bounded by what a pool may address (MAX_KV_SLOTS: slots and
block tables are int32): past it each is one line naming the flag and the limit, exit 2, before any
weight is read. --num-kv-blocks 10**12 set up a block table of 10**12 Python objects before its pool
was asked for, and --kv-cache-bytes 10**20 derived as many blocks."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.client.errors import ConfigError
from tandem.decoder.api.main import config_from_args
from tandem.decoder.api.main import main as decoder_main
from tandem.decoder.config import MAX_KV_SLOTS

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
    assert " for this model (134,217,727 blocks of " in said, said
    assert said.endswith(
        " bytes on each rank: 2,147,483,648 KV slots, int32's, of --block-size 16), "
        "got 100,000,000,000,000,000,000\n"
    ), said
