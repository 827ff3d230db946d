"""`python -m tandem.decoder --world-size 2` as processes: serves what one rank serves, and a dead
rank ends open streams with UNAVAILABLE and takes the whole group down."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2

from common.tests.ports import free_port
from tandem.client.client import DecoderClient
from tandem.common.torch_part import tensors


class DecoderProcess:
    """A decoder server subprocess whose output is collected by a thread (so its pipe never fills)."""

    def __init__(self, model_dir: Path, world_size: int) -> None:
        self.port = free_port()
        self.lines: list[str] = []
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tandem.decoder",
                *("--model", str(model_dir), "--port", str(self.port), "--dtype", "float32"),
                *("--num-threads", "1", "--world-size", str(world_size), "--grace-s", "2"),
                *("--num-kv-blocks", "1200", "--block-size", "4", "--collective-timeout-s", "20"),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")},
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def rank_pid(self, rank: int) -> int:
        for line in self.lines:
            if match := re.search(rf"started rank {rank} \(pid (\d+)\)", line):
                return int(match.group(1))
        raise AssertionError(f"no pid logged for rank {rank}:\n{''.join(self.lines)}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


async def _wait_serving(client: DecoderClient, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if await client.health(timeout=1) == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.aio.AioRpcError:
            pass  # not listening yet
        await asyncio.sleep(0.1)
    raise AssertionError("the decoder never became SERVING")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(")")[-1].split()[0] != "Z"  # a zombie has exited


async def _generate(address: str, hidden_size: int) -> tuple[list[int], str, list[float]]:
    gen = torch.Generator().manual_seed(5)
    prompt = [
        [11, 12, 13],
        tensors.encode(torch.randn(5, hidden_size, generator=gen)),  # 3 + 5 + text: odd lengths
        "The river runs to the sea",
    ]
    async with DecoderClient(address) as client:
        await _wait_serving(client)
        tokens: list[int] = []
        text: list[str] = []
        logprobs: list[float] = []
        stream = client.generate(prompt, max_new_tokens=12, temperature=0.0, ignore_eos=True, logprobs=True)
        async for response in stream:
            if response.HasField("delta"):
                tokens.extend(response.delta.token_ids)
                text.append(response.delta.text)
                logprobs.extend(response.delta.logprobs)
        return tokens, "".join(text), logprobs


async def test_two_rank_server_generates_what_a_one_rank_server_does(tiny_model_dir: Path) -> None:
    servers = [DecoderProcess(tiny_model_dir, world_size) for world_size in (1, 2)]
    try:
        one, two = await asyncio.gather(*(_generate(s.address, 64) for s in servers))
    finally:
        for server in servers:
            server.stop()
    assert two[0] == one[0] and two[1] == one[1]
    torch.testing.assert_close(torch.tensor(two[2]), torch.tensor(one[2]), rtol=1e-5, atol=1e-5)
    assert [s.process.returncode for s in servers] == [0, 0]


async def test_killing_rank_1_mid_generation_fails_the_stream_and_exits(tiny_model_dir: Path) -> None:
    server = DecoderProcess(tiny_model_dir, world_size=2)
    try:
        async with DecoderClient(server.address) as client:
            await _wait_serving(client)
            stream = client.generate([[1, 2, 3]], max_new_tokens=3000, ignore_eos=True)
            assert (await stream.read()).HasField("accepted")
            assert (await stream.read()).HasField("delta")  # decoding is under way
            rank1 = server.rank_pid(1)
            os.kill(rank1, signal.SIGKILL)
            with pytest.raises(grpc.aio.AioRpcError) as error:
                while await asyncio.wait_for(stream.read(), timeout=30) is not grpc.aio.EOF:
                    pass
            assert error.value.code() == grpc.StatusCode.UNAVAILABLE
        returncode = await asyncio.to_thread(server.process.wait, 30)  # TimeoutExpired if it lingers
        assert returncode != 0
        assert not _pid_alive(rank1)
    finally:
        if server.process.poll() is None:
            server.process.kill()
            server.process.wait()


async def test_killing_rank_0_makes_the_other_ranks_exit(tiny_model_dir: Path) -> None:
    server = DecoderProcess(tiny_model_dir, world_size=2)
    try:
        async with DecoderClient(server.address) as client:
            await _wait_serving(client)
        rank1 = server.rank_pid(1)
        server.process.kill()
        server.process.wait()
        deadline = time.monotonic() + 30
        while _pid_alive(rank1) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert not _pid_alive(rank1), "rank 1 outlived rank 0 by 30 s"
    finally:
        if server.process.poll() is None:
            server.process.kill()
            server.process.wait()
        with contextlib.suppress(ProcessLookupError, AssertionError):
            os.kill(server.rank_pid(1), signal.SIGKILL)
