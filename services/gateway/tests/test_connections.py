"""The gateway raises its open-files limit to what --max-connections needs, or refuses to start
naming the flag: a gateway out of descriptors would refuse every caller, not just the extra ones."""

from __future__ import annotations

import resource

import pytest

from tandem.client.errors import ConfigError
from tandem.gateway.connections import SPARE_DESCRIPTORS, ensure_descriptors


@pytest.fixture
def limits():
    before = resource.getrlimit(resource.RLIMIT_NOFILE)
    yield before
    resource.setrlimit(resource.RLIMIT_NOFILE, before)


def test_the_soft_limit_is_raised_to_what_the_connections_need(limits: tuple[int, int]) -> None:
    soft, hard = limits
    need = 2 * 300 + 10 + SPARE_DESCRIPTORS
    if hard != resource.RLIM_INFINITY and hard < need:
        pytest.skip(f"this process's hard limit ({hard}) is below {need}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, need - 1), hard))
    assert ensure_descriptors(300, 10) == need
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == need


def test_a_hard_limit_too_low_is_a_config_error_naming_max_connections(limits: tuple[int, int]) -> None:
    soft, hard = limits
    if hard == resource.RLIM_INFINITY:
        pytest.skip("no hard limit on open files here")
    with pytest.raises(ConfigError) as error:
        ensure_descriptors(hard, 0)  # two descriptors a connection: twice the limit
    assert error.value.field == "max_connections" and str(hard) in str(error.value)
    assert resource.getrlimit(resource.RLIMIT_NOFILE) == limits  # nothing changed
