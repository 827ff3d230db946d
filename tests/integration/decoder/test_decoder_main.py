"""`python -m services.decoder` as a process: loads, serves, drains on SIGTERM, exits 0."""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2

from common.client import DecoderClient


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_sigterm_drains_in_flight_streams_then_exits_zero(tiny_model_dir: Path) -> None:
    port = _free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.decoder",
            "--model",
            str(tiny_model_dir),
            "--port",
            str(port),
            "--dtype",
            "float32",
            "--grace-s",
            "20",
            "--num-threads",
            "1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        async with DecoderClient(f"127.0.0.1:{port}") as client:
            for _ in range(300):
                try:
                    if await client.health(timeout=1) == health_pb2.HealthCheckResponse.SERVING:
                        break
                except grpc.aio.AioRpcError:
                    pass
                await asyncio.sleep(0.1)
            else:
                raise AssertionError("the decoder never became SERVING")
            stream = client.generate([[1, 2, 3]], max_new_tokens=1500, ignore_eos=True, stream_interval=1)
            assert (await stream.read()).HasField("accepted")
            process.send_signal(signal.SIGTERM)
            responses = []
            while (response := await stream.read()) is not grpc.aio.EOF:
                responses.append(response)
            assert responses[-1].HasField("finished")
            assert responses[-1].finished.usage.output_tokens == 1500
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
