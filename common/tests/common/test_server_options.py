"""ServerOptions: each bound gRPC puts on a setting is refused when built, naming the field."""

from __future__ import annotations

import math

import pytest

from tandem.client.errors import ConfigError
from tandem.common.call_bound import grpc_bound
from tandem.common.server_options import MAX_CONCURRENT_RPCS_LIMIT, MAX_CONNECTION_AGE_S, ServerOptions


def test_max_concurrent_rpcs_must_be_at_least_one_and_at_most_what_grpc_s_arguments_hold() -> None:
    with pytest.raises(ConfigError, match=r"max_concurrent_rpcs must be in \[1, 1,000,000\], got 0"):
        ServerOptions(max_concurrent_rpcs=0)
    # gRPC's channel arguments are C ints: past them the server failed to start with an OverflowError.
    assert grpc_bound(MAX_CONCURRENT_RPCS_LIMIT) <= 2**31 - 1
    assert ServerOptions(max_concurrent_rpcs=MAX_CONCURRENT_RPCS_LIMIT).max_concurrent_rpcs == 1_000_000
    with pytest.raises(ConfigError, match=r"must be in \[1, 1,000,000\], got 1,100,000,000"):
        ServerOptions(max_concurrent_rpcs=1_100_000_000)


@pytest.mark.parametrize("age", [0.0, -1.0, math.inf, math.nan, 0.0004, 1e7, MAX_CONNECTION_AGE_S + 0.001])
def test_a_connection_age_outside_grpcs_int32_of_milliseconds_is_refused_naming_it(age: float) -> None:
    """gRPC takes the age as an int32 of milliseconds: 1e7 s failed the start with an OverflowError,
    0.0004 s was taken as 0 ms."""
    with pytest.raises(ConfigError, match=r"max_connection_age_s must be between 0.001 and 2147483.647 s"):
        ServerOptions(max_connection_age_s=age)


@pytest.mark.parametrize("size", [1023, 2**31])
def test_a_message_cap_outside_grpcs_int_is_refused_naming_it(size: int) -> None:
    """2**31 passed the `>= 1024` check and failed the start with an OverflowError."""
    with pytest.raises(ConfigError, match=r"max_message_bytes must be in 1024..2147483647 \(gRPC's int\)"):
        ServerOptions(max_message_bytes=size)


@pytest.mark.parametrize("grace", [math.nan, math.inf, -1.0])
def test_a_grace_that_is_not_a_finite_number_of_seconds_is_refused(grace: float) -> None:
    """NaN passed `< 0` and then meant no grace at all."""
    with pytest.raises(ConfigError, match="grace_s must be a finite number of seconds, 0 or more"):
        ServerOptions(grace_s=grace)
