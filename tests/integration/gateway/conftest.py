"""A live gateway in front of a live decoder and encoder (the tiny model, float32), on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from common.tests.ports import free_port
from tandem.decoder.models.loader import LoadedModel
from tandem.encoder.lookup import LookupEmbedder
from tandem.gateway.__main__ import serve as serve_gateway
from tandem.gateway.config import GatewayConfig
from tests.integration.decoder.conftest import Served, serve, shutdown
from tests.integration.encoder.conftest import Encoder, encoder_config, start_encoder, stop_encoder


@dataclass
class Live:
    base_url: str  # http://127.0.0.1:PORT/v1
    decoder: Served
    encoder: Encoder


async def start_gateway(config: GatewayConfig) -> tuple[asyncio.Task[None], int]:
    ready: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    task = asyncio.ensure_future(serve_gateway(config, ready))
    return task, await asyncio.wait_for(ready, 30)


async def stop_gateway(task: asyncio.Task[None]) -> None:
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass


@pytest.fixture
async def live(tiny_model_dir: Path, tiny_fp32: LoadedModel) -> AsyncIterator[Live]:
    decoder = await serve(tiny_model_dir, tiny_fp32)
    embedder = LookupEmbedder.load(tiny_model_dir, torch.float32)
    encoder = await start_encoder(encoder_config(tiny_model_dir), embedder)
    task, port = await start_gateway(
        GatewayConfig(
            decoder_address=decoder.server.address,
            encoder_address=encoder.server.address,
            port=0,
            max_streams_per_caller=4,
        )
    )
    try:
        yield Live(f"http://127.0.0.1:{port}/v1", decoder, encoder)
    finally:
        await stop_gateway(task)
        await stop_encoder(encoder)
        await shutdown(decoder)


@dataclass
class GatewayProcess:
    """`python -m tandem.gateway` as a process of its own (its event loop, GIL and memory apart from
    the services on this test's loop), on a free loopback port."""

    process: asyncio.subprocess.Process
    port: int
    log: Path  # its stderr

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def rss_mb(self) -> float:
        """Resident memory of the gateway and its worker processes, in MB."""
        return sum(self.rss_parts_mb())

    def rss_parts_mb(self) -> list[float]:
        """The gateway's resident memory, then each child's (its workers), in MB."""
        return [_rss_kb(pid) / 1024 for pid in self.pids()]

    def pids(self) -> list[int]:
        """The gateway, then its children (its workers)."""
        pids = [self.process.pid]
        for task in Path(f"/proc/{self.process.pid}/task").iterdir():  # children of every thread
            with contextlib.suppress(FileNotFoundError):
                pids += [int(pid) for pid in (task / "children").read_text().split()]
        return pids

    def mapped_packages(self, *packages: str) -> set[str]:
        """Which of `packages` have a file mapped into the gateway or a worker: a native library is
        mapped from the moment its package is imported, so this is what the processes loaded."""
        found = set()
        for pid in self.pids():
            with contextlib.suppress(FileNotFoundError):
                maps = Path(f"/proc/{pid}/maps").read_text()
                found.update(p for p in packages if f"/{p}/" in maps)
        return found


def _rss_kb(pid: int) -> int:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:  # a worker that just exited
        return 0
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1])


@contextlib.asynccontextmanager
async def gateway_process(
    log: Path, *flags: str, python: str | Path = sys.executable
) -> AsyncIterator[GatewayProcess]:
    """The gateway as a process with `flags` (run by `python`: this venv's, or one the gateway was
    installed into alone), once it accepts connections; terminated afterwards."""
    port = free_port()
    with log.open("wb") as err:
        process = await asyncio.create_subprocess_exec(
            str(python), "-m", "tandem.gateway", "--port", str(port), *flags, stdout=err, stderr=err
        )
    try:
        for _ in range(300):
            if process.returncode is not None:
                raise AssertionError(f"the gateway exited: {log.read_text()}")
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.close()
                break
            except OSError:
                await asyncio.sleep(0.1)
        yield GatewayProcess(process, port, log)
    finally:
        if process.returncode is None:
            process.terminate()
            await asyncio.wait_for(process.wait(), 30)
