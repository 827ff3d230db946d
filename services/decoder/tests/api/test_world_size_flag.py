"""--world-size as ranks: at most MAX_WORLD_SIZE (each rank holds whole attention heads, and no
checkpoint of the families served has more), one line naming the flag and the limit, exit 2, before
any checkpoint is read. Past it the refusal spoke of divisibility by the model's heads, as if a
larger model could take 2**63 ranks. Within it a world size the model's heads do not divide is still
refused by the model's own numbers."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.client.errors import ConfigError
from tandem.decoder.api.main import main as decoder_main
from tandem.decoder.config import MAX_WORLD_SIZE, DecoderConfig, EngineConfig

PREFIX = "tandem serve decoder: --world-size (TANDEM_WORLD_SIZE)"


@pytest.mark.parametrize("world_size", [MAX_WORLD_SIZE + 1, 100_000, 2**63])
def test_more_ranks_than_any_checkpoint_has_heads_are_one_line_naming_the_limit(
    tiny_model_dir: Path, world_size: int, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--model", str(tiny_model_dir), "--port", "0", "--world-size", str(world_size)]
    assert decoder_main(argv) == 2
    assert capsys.readouterr().err == (
        f"{PREFIX} must be at most 128 (each rank holds whole attention heads, and no checkpoint of the "
        f"families served has more than 128 query heads: Llama 3.1 405B's), got {world_size:,}\n"
    )


def test_within_the_limit_the_models_heads_decide(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert decoder_main(["--model", str(tiny_model_dir), "--port", "0", "--world-size", "3"]) == 2
    assert capsys.readouterr().err == (
        f"{PREFIX}: num_heads (4) must be divisible by the world size (3) to shard the model\n"
    )


def test_the_limit_holds_of_a_config_built_directly(tmp_path: Path) -> None:
    engine = EngineConfig(model_dir=tmp_path)
    assert DecoderConfig(engine, world_size=MAX_WORLD_SIZE).world_size == MAX_WORLD_SIZE
    with pytest.raises(ConfigError) as error:
        DecoderConfig(engine, world_size=MAX_WORLD_SIZE + 1)
    assert error.value.field == "world_size"
