"""The record of refused health Watch streams: each address's refusals logged at most once an interval.

NOTE: why ordered, and capped. gRPC's client-side health checking keeps a refusal's reason to itself,
so the server logs it (`health.py`), at most once an interval per address (IPv4, or IPv6 /64) with
the count refused since. Addresses are kept in the order their last warning was logged, so those an
interval old are popped from the front as later ones are refused: each refusal costs O(1) amortised,
where a scan of every address kept cost O(n) a refusal, and a caller rotating addresses (20,000 /64s
in a minute, one IPv6 host's worth) held the event loop 31.5 s. Past MAX_WATCHERS_LOGGED addresses
the rest are counted together, one warning an interval for all of them, so neither memory nor the log
grows with the addresses a caller can rotate through.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

# A refused Watch is logged at most this often per address, with how many were refused since.
REFUSAL_LOG_INTERVAL_S = 60.0
# Addresses whose refusals are logged one by one within an interval; past them, one line for the rest.
MAX_WATCHERS_LOGGED = 1024


@dataclass(slots=True)
class _Refusals:
    logged_at: float  # when the last warning naming them was logged (time.monotonic)
    num_since: int  # refused since that warning
    bound: str  # the bound the last of them met


class WatchRefusals:
    """Refused Watch streams counted by watcher (`health.watcher_of`) and logged to `log` at most once
    an `interval_s` each, past `max_watchers` all others together; event-loop thread only."""

    def __init__(
        self,
        log: logging.Logger,
        interval_s: float = REFUSAL_LOG_INTERVAL_S,
        max_watchers: int = MAX_WATCHERS_LOGGED,
    ) -> None:
        self.log = log
        self.interval_s = interval_s
        self.max_watchers = max_watchers
        # By watcher, in the order of their last warning (oldest first): logged_at never decreases.
        self._by_watcher: OrderedDict[str, _Refusals] = OrderedDict()
        # Refusals of watchers past max_watchers, counted together (no watcher kept: bounded memory).
        self._others = _Refusals(logged_at=float("-inf"), num_since=0, bound="")

    @property
    def num_watchers(self) -> int:
        """Watchers whose refusals are counted one by one now."""
        return len(self._by_watcher)

    def refused(self, watcher: str, bound: str, now: float) -> None:
        """Counts a Watch of `watcher` refused at `now` for `bound`, logging it where its watcher's last
        warning is an interval old (or it has none)."""
        refusals = self._by_watcher.get(watcher)
        if refusals is not None and now - refusals.logged_at < self.interval_s:
            refusals.num_since += 1
            refusals.bound = bound
            return
        num_refused = 1 if refusals is None else refusals.num_since + 1
        self._by_watcher.pop(watcher, None)
        self._forget_logged_before(now - self.interval_s, now)
        if len(self._by_watcher) < self.max_watchers:
            self._log(num_refused, watcher, bound)
            self._by_watcher[watcher] = _Refusals(now, 0, bound)  # at the end: the latest logged
            return
        self._others.num_since += num_refused
        self._others.bound = bound
        if now - self._others.logged_at >= self.interval_s:
            self._log_others(now)

    def _forget_logged_before(self, then: float, now: float) -> None:
        """Drops the watchers last logged before `then`, from the front, logging what they were refused
        since, so that those kept are the ones logged within an interval; and the others' count where
        its warning is that old."""
        while self._by_watcher:
            watcher, refusals = next(iter(self._by_watcher.items()))
            if refusals.logged_at >= then:
                break
            del self._by_watcher[watcher]
            if refusals.num_since:
                self._log(refusals.num_since, watcher, refusals.bound)
        if self._others.num_since and self._others.logged_at < then:
            self._log_others(now)

    def _log(self, num_refused: int, watcher: str, bound: str) -> None:
        self.log.warning(
            "%d health Watch stream(s) from %s refused since the last such warning: %s "
            "(while the service serves, a client's balanced channel so refused calls the server unwatched)",
            num_refused,
            watcher,
            bound,
        )

    def _log_others(self, now: float) -> None:
        self.log.warning(
            "%d health Watch stream(s) refused since the last such warning from addresses past the %d "
            "logged one by one: %s (the last bound met; while the service serves, a client's balanced "
            "channel so refused calls the server unwatched)",
            self._others.num_since,
            self.max_watchers,
            self._others.bound,
        )
        self._others = _Refusals(logged_at=now, num_since=0, bound="")
