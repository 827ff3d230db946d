"""gRPC's own failure of a call (no connection, a connection lost, a deadline passed), told from a
service's status, and the WARNING lines that say them, rate-limited.

Both the gateway (its calls to a decoder or an encoder) and the decoder (its Embed calls to an
encoder) tell them apart by one rule and log them by one limiter: the decoder's copy of the rule logged
every one, so a stopped encoder wrote N identical lines for a request of N encoder parts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import grpc

# The trailer a service's own status travels in (`tandem.client.status`, google.rpc.Status): every
# refusal of a Tandem service's carries it (the decoder's "loading" and an encoder's "still loading"
# too), gRPC's own failures of a call do not.
STATUS_DETAILS_KEY = "grpc-status-details-bin"
# The codes gRPC itself ends a call with when the service never said a word: no connection or one lost,
# and a deadline passed.
GRPCS_OWN_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
# gRPC's own failures are logged at most once in this many seconds for each service and code, the line
# saying how many went unlogged since: a stopped service fails every call, and each was a WARNING line
# of its own (a completion a second behind a stopped decoder: a line a second, the same words each).
WARN_EVERY_S = 10.0


def is_grpcs_own(error: grpc.aio.AioRpcError) -> bool:
    """Whether `error` is gRPC's own UNAVAILABLE or DEADLINE_EXCEEDED, not a service's status: those
    carry google.rpc details (STATUS_DETAILS_KEY)."""
    if error.code() not in GRPCS_OWN_CODES:
        return False
    return not any(key == STATUS_DETAILS_KEY for key, _ in error.trailing_metadata() or ())


class GrpcsOwnWarnings:
    """When each (service, code) of gRPC's own failures was last logged to `log`, and those not logged
    since. `service` is whatever names the one called (the gateway's "decoder", an encoder's address)."""

    def __init__(
        self,
        log: logging.Logger,
        every_s: float = WARN_EVERY_S,
        clock: Callable[[], float] = time.monotonic,  # tests pass one they move by hand
    ) -> None:
        self.log = log
        self.every_s = every_s
        self._clock = clock
        self._last: dict[tuple[str, grpc.StatusCode], tuple[float, int]] = {}  # -> (logged at, skipped)

    def warn(self, service: str, code: grpc.StatusCode, line: str) -> None:
        """Log `line` (its words for this failure) at WARNING unless one for `service` and `code` was
        logged less than `every_s` ago; the next logged says how many were skipped."""
        now = self._clock()
        last = self._last.get((service, code))
        if last is not None and now - last[0] < self.every_s:
            self._last[service, code] = (last[0], last[1] + 1)
            return
        self._last[service, code] = (now, 0)
        more = f" ({last[1]} more since the last such line)" if last is not None and last[1] else ""
        self.log.warning("%s%s", line, more)
