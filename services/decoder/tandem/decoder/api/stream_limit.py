"""At most N open Generate streams per connection, so that one caller cannot hold the whole batch.

A connection is a peer address as gRPC reports it (`ipv4:10.0.0.7:53122`): one client channel, or
one proxy's channel for all of its clients. Beyond the bound a new Generate ends RESOURCE_EXHAUSTED
at once, with RetryInfo, before anything is built; the caller may retry when one of its streams ends,
or open another connection. HTTP/2's own SETTINGS_MAX_CONCURRENT_STREAMS is not used: gRPC clients
race it and see their extra streams reset (UNAVAILABLE, which Generate never retries), where this
bound answers with a status that says what happened.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

from tandem.client import error_reasons as reasons
from tandem.client.errors import ResourceExhausted


class StreamLimit:
    """Counts the open streams of each connection (or, for `holder` "bearer token", of each token);
    event-loop thread only (no lock)."""

    def __init__(
        self, max_streams: int | None, holder: str = "connection", flag: str = "--max-streams-per-connection"
    ) -> None:
        self.max_streams = max_streams  # None: no bound
        self.holder = holder  # what the error calls the key
        self.flag = flag
        self._open: Counter[str] = Counter()

    def num_open(self, peer: str) -> int:
        return self._open[peer]

    @contextlib.contextmanager
    def open(self, peer: str) -> Iterator[None]:
        """Holds one of `peer`'s streams for the body. Raises ResourceExhausted beyond the bound."""
        if self.max_streams is not None and self._open[peer] >= self.max_streams:
            advice = "end one or use another connection" if self.holder == "connection" else "end one"
            raise ResourceExhausted(
                f"this {self.holder} already has {self.max_streams} Generate streams open "
                f"({self.flag}); {advice}",
                retry_after_s=1.0,
                info=reasons.decoder_info(
                    reasons.STREAM_LIMIT,
                    {
                        reasons.HOLDER: self.holder,
                        reasons.MAX_STREAMS: self.max_streams,
                        reasons.FLAG: self.flag,
                    },
                ),
            )
        self._open[peer] += 1
        try:
            yield
        finally:
            self._open[peer] -= 1
            if not self._open[peer]:
                del self._open[peer]
