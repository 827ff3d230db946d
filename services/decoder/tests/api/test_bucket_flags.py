"""--seq-buckets, --token-buckets, --block-table-buckets pad static-shape steps only: given without
--static-shapes true they are refused as unused, one line naming the flag, exit 2, as
--quantization-group-size is without int4. They were ignored, silently, and the decoder served eager
steps of shapes the operator never asked for."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.client.errors import ConfigError
from tandem.decoder.api.main import main as decoder_main
from tandem.decoder.config import EngineConfig

FLAGS = ["--seq-buckets", "--token-buckets", "--block-table-buckets"]


@pytest.mark.parametrize("flag", FLAGS)
def test_a_bucket_flag_without_static_shapes_is_one_line_naming_it(
    flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert decoder_main([flag, "4", "--port", "0"]) == 2
    variable = "TANDEM_" + flag.removeprefix("--").replace("-", "_").upper()
    assert capsys.readouterr().err == (
        f"tandem serve decoder: {flag} ({variable}) is only used with --static-shapes true (eager steps "
        "are not padded)\n"
    )


@pytest.mark.parametrize("field", ["seq_buckets", "token_buckets", "block_table_buckets"])
def test_buckets_are_taken_with_static_shapes_and_refused_without(field: str) -> None:
    assert getattr(EngineConfig(model_dir=Path("m"), static_shapes=True, **{field: (4,)}), field) == (4,)
    with pytest.raises(ConfigError) as error:
        EngineConfig(model_dir=Path("m"), **{field: (4,)})
    assert error.value.field == field
