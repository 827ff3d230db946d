"""The README's configuration tables list every flag of both services with its environment variable."""

import re
from pathlib import Path

from services.decoder.api.main import build_parser as decoder_parser
from services.encoder.__main__ import build_parser as encoder_parser

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()
ROWS = set(re.findall(r"^\| `(--[a-z0-9-]+)` \| `([A-Z0-9_]+)` \|", README, flags=re.MULTILINE))


def _flags(parser) -> list[str]:
    return [s for a in parser._actions for s in a.option_strings if s.startswith("--") and s != "--help"]


def test_every_decoder_flag_is_documented_with_its_env_var() -> None:
    missing = [
        f for f in _flags(decoder_parser()) if (f, "TANDEM_" + f[2:].upper().replace("-", "_")) not in ROWS
    ]
    assert not missing, f"README configuration table lacks decoder flags: {missing}"


def test_every_encoder_flag_is_documented_with_its_env_var() -> None:
    expected = {f: "TANDEM_ENCODER_" + f[2:].upper().replace("-", "_") for f in _flags(encoder_parser())}
    missing = [f for f, env in expected.items() if (f, env) not in ROWS]
    assert not missing, f"README configuration table lacks encoder flags: {missing}"
