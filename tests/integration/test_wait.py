"""`tandem wait` (tandem.readiness): it returns once every target serves, and says which did not."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from common.tests.ports import free_port
from tandem import cli
from tandem.decoder.models.loader import LoadedModel
from tests.integration.reliability.harness import Services


@pytest.fixture(scope="module")
def services(tiny_model_dir: Path, tiny_fp32: LoadedModel) -> Iterator[Services]:
    running = Services(tiny_model_dir, tiny_fp32)
    yield running
    running.close()


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
        self.send_response(200 if self.path == "/health" else 503)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        return None


@pytest.fixture
def http_health() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _closed_port() -> str:
    return f"127.0.0.1:{free_port()}"  # below the ephemeral range (ports.py)


def test_wait_returns_once_every_target_serves(services: Services, http_health: str, capsys) -> None:
    targets = [services.encoder_server.address, services.decoder_server.address, f"{http_health}/health"]
    assert cli.main(["wait", *targets, "--timeout-s", "60"]) == 0
    assert capsys.readouterr().out == f"serving: {', '.join(targets)}\n"


def test_wait_names_what_does_not_serve_when_it_gives_up(
    services: Services, http_health: str, capsys
) -> None:
    closed = _closed_port()
    argv = ["wait", services.decoder_server.address, closed, f"{http_health}/other", "--timeout-s", "0.1"]
    assert cli.main(argv) == 1
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1
    assert err.startswith(f"tandem wait: not serving after 0.1 s: {closed}: UNAVAILABLE: "), err
    assert f"{http_health}/other: HTTP 503" in err and services.decoder_server.address not in err
