"""`tandem up`'s settings (`up_config.py`): what UpConfig refuses of them alone, before anything is
checked against the machine or the services."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from common.tests.up_configs import up_config
from tandem.client.errors import ConfigError


@pytest.mark.parametrize("grace", [math.nan, math.inf, -1.0])
def test_a_grace_that_is_not_a_finite_number_of_seconds_is_refused(
    tiny_model_dir: Path, grace: float
) -> None:
    """NaN passed `< 0`: the services refused it once started, and `up` killed them at once."""
    with pytest.raises(ConfigError, match="grace_s must be a finite number of seconds"):
        up_config(tiny_model_dir, grace_s=grace)
