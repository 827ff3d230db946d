"""tandem.readiness's Probe, as `tandem up` and `tandem wait` use it: a target that serves is asked no
more while the others are awaited, and the probing ends once every target serves (nothing goes on
asking every 0.2 s after a start)."""

from __future__ import annotations

import http.server
import threading
from collections import Counter
from collections.abc import Iterator

import pytest

from tandem.readiness import Probe

NUM_NOT_YET = 2  # /later answers 503 this many times, then 200


class _Counting(http.server.BaseHTTPRequestHandler):
    asked: Counter[str]

    def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
        self.asked[self.path] += 1
        is_serving = self.path == "/health" or self.asked[self.path] > NUM_NOT_YET
        self.send_response(200 if is_serving else 503)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        return None


@pytest.fixture
def counting_server() -> Iterator[tuple[str, Counter[str]]]:
    """A loopback HTTP server (its base URL) and how often each path was asked."""
    asked: Counter[str] = Counter()
    handler = type("Handler", (_Counting,), {"asked": asked})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", asked
    server.shutdown()
    server.server_close()
    thread.join()


def test_a_target_that_serves_is_not_asked_again_and_probing_ends_once_all_serve(
    counting_server: tuple[str, Counter[str]],
) -> None:
    url, asked = counting_server
    probe = Probe([f"{url}/health", f"{url}/later"])
    try:
        assert probe.wait(timeout_s=10) == {}
    finally:
        probe.close()
    assert asked == {"/health": 1, "/later": NUM_NOT_YET + 1}
