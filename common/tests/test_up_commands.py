"""What `tandem up` runs for each service and where it then reaches it (`up_commands.py`)."""

from __future__ import annotations

from pathlib import Path

from common.tests.up_configs import up_config
from tandem import up_commands


def test_the_services_are_reached_at_an_ipv6_host_in_brackets(tiny_model_dir: Path) -> None:
    """ "::1:50781" was no address the decoder's --encoder or `tandem wait` could use."""
    config = up_config(tiny_model_dir, host="::1")
    assert up_commands.ready_targets(config)["the encoder"] == "[::1]:50781"
    assert "[::1]:50781" in up_commands.serve_command("decoder", config)
    assert up_commands.ready_targets(up_config(tiny_model_dir, host="::"))["the decoder"] == "127.0.0.1:50782"
