"""`tandem up`'s settings as the tests build them: fixed ports nothing binds (UpConfig checks only their
range), the fields a test names on top."""

from __future__ import annotations

from pathlib import Path

from tandem.up_config import UpConfig

ENCODER_PORT, DECODER_PORT = 50781, 50782


def up_config(model_dir: Path | None, host: str = "127.0.0.1", **fields: object) -> UpConfig:
    return UpConfig(model_dir, host, ENCODER_PORT, DECODER_PORT, None, None, **fields)  # type: ignore[arg-type]
