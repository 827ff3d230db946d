"""What the decoder's process tests share: a free local port, a decoder process that is always
stopped, and waiting until a decoder serves."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2

from tandem.client.client import DecoderClient


@dataclass
class DecoderRun:
    process: subprocess.Popen[bytes]
    output: str = ""  # its stdout and stderr together, once it stopped


@contextmanager
def decoder_process(args: list[str], env: dict[str, str] | None = None) -> Iterator[DecoderRun]:
    """`python -m tandem.decoder ARGS` on one thread, without the developer's TANDEM_* variables (`env`
    added). Leaving the block stops it with SIGTERM, and its exit status must then be 0; a block that
    raised kills it instead. Its output is in `.output` after the block."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    environment |= {"OMP_NUM_THREADS": "1", **(env or {})}
    command = [sys.executable, "-m", "tandem.decoder", *args, "--num-threads", "1"]
    process = subprocess.Popen(command, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    run = DecoderRun(process)
    code = None
    try:
        yield run
        run.process.send_signal(signal.SIGTERM)
        code = run.process.wait(timeout=90)
    finally:
        if run.process.poll() is None:
            run.process.kill()
        run.output = run.process.communicate()[0].decode(errors="replace")
    assert code == 0, run.output


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
