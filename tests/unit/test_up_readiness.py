"""`tandem up --openai-port`'s readiness: the gateway's /health, which answers 503 (and logs a line)
until the decoder serves, is probed only once the encoder and the decoder serve, then once more."""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tandem.up_config import UpConfig
from tandem.up_processes import _announce_ready

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class _CountingHealth(health.HealthServicer):
    """The services' gRPC health (both ports), counting the checks: not serving until `serve()`."""

    def __init__(self) -> None:
        super().__init__()
        self.num_checks = 0
        self.is_serving = False
        self.set("", NOT_SERVING)

    def serve(self) -> None:
        self.is_serving = True
        self.set("", SERVING)

    def Check(self, request: health_pb2.HealthCheckRequest, context: grpc.ServicerContext):  # noqa: N802
        self.num_checks += 1
        return super().Check(request, context)


@dataclass
class Started:
    config: UpConfig  # up's, naming the ports below
    services: _CountingHealth
    gateway_asked: list[int]  # the status of each answer of the gateway's /health, in order


@pytest.fixture
def started() -> Iterator[Started]:
    """What `up` probes as it starts: an encoder and a decoder not serving yet, and a gateway whose
    /health answers 200 only while they serve, as the real one does."""
    services = _CountingHealth()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(services, server)
    encoder_port = server.add_insecure_port("127.0.0.1:0")
    decoder_port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    asked: list[int] = []

    class Gateway(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
            asked.append(200 if services.is_serving else 503)
            self.send_response(asked[-1])
            self.end_headers()

        def log_message(self, *args: object) -> None:
            return None

    gateway = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Gateway)
    thread = threading.Thread(target=gateway.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    config = UpConfig(
        None, "127.0.0.1", encoder_port, decoder_port, None, None, openai_port=gateway.server_address[1]
    )
    try:
        yield Started(config, services, asked)
    finally:
        gateway.shutdown()
        gateway.server_close()
        thread.join()
        server.stop(None).wait()


def test_the_gateway_is_probed_only_once_both_services_serve(started: Started, capsys) -> None:
    stopping = threading.Event()
    announcing = threading.Thread(target=_announce_ready, args=(started.config, stopping))
    announcing.start()
    try:
        deadline = time.monotonic() + 10
        while started.services.num_checks < 6 and time.monotonic() < deadline:  # 3 rounds of both
            time.sleep(0.05)
        assert started.services.num_checks >= 6
        assert started.gateway_asked == []
        started.services.serve()
        announcing.join(10)
        assert not announcing.is_alive()
    finally:
        stopping.set()
        announcing.join(10)
    assert started.gateway_asked == [200]
    assert "[up] ready: " in capsys.readouterr().out
