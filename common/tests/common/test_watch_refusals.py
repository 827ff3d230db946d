"""Refused health Watch streams are logged at most once an interval per address, with the count
refused since, and the record of them stays bounded however many addresses a caller rotates through."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import pytest

from tandem.common.watch_refusals import REFUSAL_LOG_INTERVAL_S, WatchRefusals

BOUND = "at most 4 health Watch streams at once"


class _Warnings(logging.Handler):
    """The messages logged to it, in order."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def warnings() -> Iterator[list[str]]:
    """The warnings logged, as they come (the same list, growing)."""
    handler = _Warnings()
    logger = logging.getLogger("test.watch_refusals")
    logger.addHandler(handler)
    logger.propagate = False  # 1,025 lines: kept out of pytest's capture
    try:
        yield handler.messages
    finally:
        logger.removeHandler(handler)
        logger.propagate = True


def _refusals(max_watchers: int = 1024) -> WatchRefusals:
    return WatchRefusals(logging.getLogger("test.watch_refusals"), max_watchers=max_watchers)


def test_each_address_is_logged_at_its_first_refusal_then_once_an_interval_with_the_count_since(
    warnings: list[str],
) -> None:
    refusals = _refusals()
    for now in (0.0, 1.0, 2.0):
        refusals.refused("10.0.0.1", BOUND, now)
        refusals.refused("10.0.0.2", BOUND, now + 0.5)
    assert [w.split(" refused")[0] for w in warnings] == [
        "1 health Watch stream(s) from 10.0.0.1",
        "1 health Watch stream(s) from 10.0.0.2",
    ]
    refusals.refused("10.0.0.1", BOUND, REFUSAL_LOG_INTERVAL_S)  # its warning a minute old: 2 since, and this
    assert warnings[2].startswith(
        "3 health Watch stream(s) from 10.0.0.1 refused since the last such warning"
    )
    assert BOUND in warnings[2]


def test_an_address_forgotten_an_interval_after_its_warning_logs_the_refusals_it_had_since(
    warnings: list[str],
) -> None:
    refusals = _refusals()
    refusals.refused("10.0.0.1", BOUND, 0.0)
    refusals.refused("10.0.0.1", BOUND, 5.0)
    refusals.refused("10.0.0.2", BOUND, 30.0)
    refusals.refused("10.0.0.3", BOUND, 61.0)  # 10.0.0.1 is forgotten, its one refusal since logged
    assert [w.split(" refused")[0] for w in warnings] == [
        "1 health Watch stream(s) from 10.0.0.1",
        "1 health Watch stream(s) from 10.0.0.2",
        "1 health Watch stream(s) from 10.0.0.1",
        "1 health Watch stream(s) from 10.0.0.3",
    ]
    assert refusals.num_watchers == 2  # 10.0.0.2 (logged 31 s ago) and 10.0.0.3


def test_addresses_past_the_cap_are_counted_in_one_warning_an_interval(warnings: list[str]) -> None:
    refusals = _refusals(max_watchers=3)
    for index in range(10):
        refusals.refused(f"2001:db8:0:{index:x}::/64", BOUND, float(index))
    assert refusals.num_watchers == 3
    assert len(warnings) == 4  # 3 addresses one by one, then the first of the others at once
    assert warnings[3].startswith(
        "1 health Watch stream(s) refused since the last such warning from addresses past the 3 logged "
        "one by one: " + BOUND
    )
    refusals.refused("2001:db8:0:ff::/64", BOUND, 70.0)  # the kept ones forgotten: logged one by one
    assert warnings[4:] == [
        "6 health Watch stream(s) refused since the last such warning from addresses past the 3 logged "
        "one by one: " + BOUND + " (the last bound met; while the service serves, a client's balanced "
        "channel so refused calls the server unwatched)",
        warnings[5],
    ]
    assert warnings[5].startswith("1 health Watch stream(s) from 2001:db8:0:ff::/64")


def test_a_caller_rotating_addresses_costs_bounded_entries_and_time(warnings: list[str]) -> None:
    """20,000 IPv6 /64s refused in a minute: each refusal scanned every address kept (31.5 s of the
    event loop in all), and every one was kept."""
    refusals = _refusals()
    start = time.thread_time()  # CPU time: the suite's other worker stretches the wall clock, not the work
    for index in range(20_000):
        refusals.refused(f"2001:db8:{index >> 16:x}:{index & 0xFFFF:x}::/64", BOUND, index * 0.003)
    elapsed = time.thread_time() - start
    assert refusals.num_watchers == 1024
    assert len(warnings) == 1025  # 1,024 addresses, then one for all the others within the minute
    assert elapsed < 2.0, elapsed
