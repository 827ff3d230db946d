"""`python -m tandem.encoder` as a process: starts, turns SERVING, embeds, exits 0 on SIGTERM."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.client.pb.tandem.v1 import encoder_pb2, encoder_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parents[3]
STARTUP_TIMEOUT_S = 30.0
EXIT_TIMEOUT_S = 15.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_serving(channel: grpc.Channel, process: subprocess.Popen) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        assert process.poll() is None, f"encoder exited early with {process.returncode}"
        try:
            reply = health.Check(health_pb2.HealthCheckRequest(service="tandem.v1.Encoder"), timeout=1)
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.RpcError:
            pass  # not listening yet
        time.sleep(0.1)
    raise AssertionError(f"encoder not SERVING within {STARTUP_TIMEOUT_S} s")


def test_module_serves_until_sigterm_and_exits_0(tiny_model: Path) -> None:
    port = _free_port()
    command = [sys.executable, "-m", "tandem.encoder", "--model", str(tiny_model), "--port", str(port)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_ENCODER_")}
    process = subprocess.Popen(
        [*command, "--grace-s", "1"], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            _wait_serving(channel, process)
            reply = encoder_pb2_grpc.EncoderStub(channel).Embed(
                encoder_pb2.EmbedRequest(text="hi"), timeout=5
            )
            assert reply.embeddings.shape[0] == reply.usage.input_tokens >= 1
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=EXIT_TIMEOUT_S)
        assert process.returncode == 0, output.decode(errors="replace")
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
