"""Several decoder replicas behind one client address: gRPC's round-robin with client-side health
checking (`tandem.client.channel`), on loopback.

Each replica serves a differently seeded tiny checkpoint, so a greedy answer says which replica gave
it; the references come from a channel to each replica alone.
"""

from __future__ import annotations

import asyncio
import collections
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from common.tests.ports import free_port
from tandem.client.client import DecoderClient
from tandem.common.server import ServerOptions, Service, start_server
from tandem.common.torch_part.random_model import make_model

PROMPT = [[1, 2, 3, 4]]


async def _answer(client: DecoderClient) -> tuple[int, ...]:
    text_ids = []
    async for response in client.generate(
        PROMPT, max_new_tokens=4, temperature=0.0, ignore_eos=True, timeout=30
    ):
        if response.HasField("delta"):
            text_ids.extend(response.delta.token_ids)
    return tuple(text_ids)


class Replica:
    def __init__(self, model_dir: Path) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        argv = [
            "--model",
            str(model_dir),
            "--port",
            str(self.port),
            "--dtype",
            "float32",
            "--num-threads",
            "1",
        ]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TANDEM_", "OTEL_"))}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tandem.decoder", *argv, "--grace-s", "1"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return [make_model(tmp_path_factory.mktemp(f"replica-{seed}"), seed=seed) for seed in (0, 1)]


@pytest.fixture
async def replicas(model_dirs: list[Path]) -> AsyncIterator[list[Replica]]:
    started = [Replica(model_dir) for model_dir in model_dirs]
    try:
        for replica in started:
            async with DecoderClient(replica.address) as alone:
                await alone.wait_serving(timeout=120)
        yield started
    finally:
        for replica in started:
            replica.stop()


async def test_requests_spread_over_both_replicas_from_the_first_burst_and_killing_one_fails_none(
    replicas: list[Replica],
) -> None:
    answers = []
    for replica in replicas:
        async with DecoderClient(replica.address) as alone:
            answers.append(await _answer(alone))
    assert answers[0] != answers[1]  # different weights: an answer names its replica
    # A third "replica" that never becomes SERVING (health only, no Decoder service): client-side
    # health checking keeps every call away from it, where it would fail UNIMPLEMENTED.
    unhealthy = await start_server(ServerOptions(port=0), [])
    address = ",".join([replicas[0].address, replicas[1].address, unhealthy.address])
    try:
        # A fresh client's first burst, no wait_serving first: streams started together all went to
        # the replica that connected first (round_robin picks among connected ones: 6/0 in 3 of 4
        # runs); its first calls now wait for every connection (`tandem.client.first_calls`).
        async with DecoderClient(address) as fresh:
            first = collections.Counter(await asyncio.gather(*(_answer(fresh) for _ in range(6))))
        assert first == {answers[0]: 3, answers[1]: 3}, first
        async with DecoderClient(address) as balanced:
            await balanced.wait_serving(timeout=60)
            served = collections.Counter([await _answer(balanced) for _ in range(12)])
            assert set(served) == set(answers), served
            assert min(served.values()) >= 3, served  # round-robin, not a first pick that sticks

            replicas[0].process.send_signal(signal.SIGKILL)
            replicas[0].process.wait()
            after = [await _answer(balanced) for _ in range(8)]  # each a new request, none failing
            assert after == [answers[1]] * 8
    finally:
        await unhealthy.stop(0)


def test_several_addresses_must_be_one_address_family() -> None:
    from tandem.client.addresses import channel_target

    assert channel_target("127.0.0.1:1,localhost:2") == ("ipv4:127.0.0.1:1,127.0.0.1:2", True)
    assert channel_target(["[::1]:1", "[::1]:2"]) == ("ipv6:[::1]:1,[::1]:2", True)
    assert channel_target("dns:///decoder.tandem.svc:50052") == ("dns:///decoder.tandem.svc:50052", True)
    assert channel_target("decoder:50052") == ("decoder:50052", False)
    with pytest.raises(ValueError, match="mixes IPv4 and IPv6"):
        channel_target("127.0.0.1:1,[::1]:2")
    with pytest.raises(ValueError, match="expected host:port"):
        channel_target("127.0.0.1:1,nowhere")


async def test_a_balanced_client_waits_for_a_serving_replica_rather_than_failing() -> None:
    """A balanced channel uses a server only once its health says SERVING; wait_serving waits for that."""
    # Health for tandem.v1.Decoder, NOT_SERVING until set; no Decoder calls are made here.
    server = await start_server(ServerOptions(port=0), [Service("tandem.v1.Decoder", None, lambda *_: None)])
    try:
        async with DecoderClient(f"{server.address},{server.address}") as client:
            with pytest.raises(TimeoutError):
                await client.wait_serving(timeout=1.0)
            await server.set_serving()
            await asyncio.wait_for(client.wait_serving(timeout=10), 15)
    finally:
        await server.stop(0)
