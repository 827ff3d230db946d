"""`tandem wait`: a target or a timeout it cannot use is refused at once, naming it, exit 2."""

from __future__ import annotations

import time

import pytest

from tandem import cli


@pytest.mark.parametrize(
    "target", ["", "::::", "127.0.0.1:116328", "http://", "http://x:99999/health", "a:1,b:2"]
)
def test_a_target_that_is_not_an_address_is_refused_at_once(
    target: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each was probed until --timeout-s passed, then exit 1 with gRPC's trace lines (port 116328
    reached port 50792)."""
    began = time.monotonic()
    assert cli.main(["wait", "--timeout-s", "30", target]) == 2
    assert time.monotonic() - began < 5
    assert f"tandem wait: TARGET {target!r}: " in capsys.readouterr().err


@pytest.mark.parametrize("timeout", ["nan", "inf", "-1"])
def test_a_timeout_that_is_not_a_finite_number_of_seconds_is_refused(
    timeout: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """click.FloatRange(min=0) took NaN: the wait never ended."""
    assert cli.main(["wait", "--timeout-s", timeout, "127.0.0.1:1"]) == 2
    assert "--timeout-s (TANDEM_WAIT_TIMEOUT_S): " in capsys.readouterr().err
