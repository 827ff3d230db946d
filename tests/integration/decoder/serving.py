"""What the decoder's process tests share: a free local port, and waiting until a decoder serves."""

from __future__ import annotations

import asyncio
import socket
import subprocess

import grpc
from grpc_health.v1 import health_pb2

from tandem.client.client import DecoderClient


def free_port() -> int:
    """A port on 127.0.0.1 nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def until_serving(
    client: DecoderClient, process: subprocess.Popen[bytes] | None = None, within_s: float = 90.0
) -> None:
    """Returns once the decoder behind `client` reports SERVING; AssertionError if it does not within
    `within_s`, or if `process` (the decoder's, when the test started it) exits first, with its output."""
    for _ in range(int(within_s * 10)):
        try:
            if await client.health(timeout=1) == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.aio.AioRpcError:
            pass
        if process is not None and process.poll() is not None:
            output = process.stdout.read().decode(errors="replace") if process.stdout else ""
            raise AssertionError(f"the decoder exited {process.returncode} before serving:\n{output}")
        await asyncio.sleep(0.1)
    raise AssertionError("the decoder never became SERVING")
