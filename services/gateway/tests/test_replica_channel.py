"""A channel to one replica (`replica_channel.py`): over one decoder, a process stopped for good is out
within the replicas' keepalive and the calls sent to it end; one whose event loop is held stays in."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from tandem.client.pb.tandem.v1 import decoder_pb2
from tandem.gateway.callers import CallerChannels, decoder_channels
from tandem.gateway.config import GatewayConfig

# A fake decoder in a process of its own (a SIGSTOP stops all of it, gRPC's threads too); SIGUSR1
# holds its event loop for the seconds given, as a busy decoder's is held (gRPC's threads still run).
DECODER = """
import asyncio, signal, sys, time
from tests.fake_decoder import fake_decoder
signal.signal(signal.SIGUSR1, lambda *_: time.sleep(float(sys.argv[1])))
async def main():
    async with fake_decoder() as (_, address):
        print(address, flush=True)
        await asyncio.Event().wait()
asyncio.run(main())
"""
HOLD_S = 7.0  # past the replicas' keepalive (2 s + 3 s) and a Check's 2 s
# How soon a stopped decoder's call ends and the decoder is out: latency is the promise, so the bound
# stays a time. It lies between what the replicas' keepalive takes (9.5 s idle; the whole test 9.3-11.6 s
# in 10 runs beside a second copy of it: timers in gRPC's threads, which a busy CPU delays by little,
# finding a process that is stopped, not slow) and the 28 s the old keepalive took at best. Counted from
# the stop, by the call's own deadline.
STOPPED_BOUND_S = 20.0


@pytest.fixture
async def decoder() -> AsyncIterator[tuple[subprocess.Popen[str], CallerChannels]]:
    """A fake decoder's process, and the gateway's caller channels over it alone, seen serving."""
    process = subprocess.Popen(
        [sys.executable, "-c", DECODER, str(HOLD_S)],
        cwd=Path(__file__).parents[1],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    try:
        address = (await asyncio.to_thread(process.stdout.readline)).strip()
        channels = decoder_channels(GatewayConfig(decoder_address=address))
        try:
            async with asyncio.timeout(5):
                while not channels.replicas.called:
                    await asyncio.sleep(0.01)
            yield process, channels
        finally:
            await channels.close()
    finally:
        os.kill(process.pid, signal.SIGCONT)
        process.kill()
        process.wait()


async def _generate(channels: CallerChannels, timeout_s: float = 60) -> None:
    request = decoder_pb2.GenerateRequest(prompt=[decoder_pb2.PromptSegment(text="hi")])
    async with channels.stub("peer:a") as stub:
        async for _ in stub.Generate(request, timeout=timeout_s):
            pass


async def test_a_single_decoder_stopped_for_good_is_out_and_its_calls_end_within_seconds(
    decoder: tuple[subprocess.Popen[str], CallerChannels],
) -> None:
    """Stopped (SIGSTOP) with its connections open: the only serving replica, its late Checks left it
    in (`Replicas._late_check`), so the gateway found it by gRPC's keepalive for one server: out ~12 s
    after the stop, a completion sent then hung 28-60 s. The replicas' keepalive ends its Watch and
    the call's connection: the call ended at 9.5 s here (a ping 2 s after the last traffic, 3 s for its
    answer, then gRPC's close of a connection with a write in flight), so the bound is 20 s, under the
    28 s the old keepalive took at best; 10 s failed a loaded CI run."""
    process, channels = decoder
    await _generate(channels)
    started = time.monotonic()
    os.kill(process.pid, signal.SIGSTOP)
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await _generate(channels, timeout_s=STOPPED_BOUND_S)
    # Ended by the keepalive: not past its deadline (DEADLINE_EXCEEDED, the old keepalive's hang).
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    async with asyncio.timeout(STOPPED_BOUND_S - (time.monotonic() - started)):
        while channels.targets:
            await asyncio.sleep(0.05)


async def test_a_single_decoder_whose_loop_is_held_past_the_keepalive_stays_in_and_answers(
    decoder: tuple[subprocess.Popen[str], CallerChannels],
) -> None:
    """Its loop held HOLD_S (a long prefill on few cores): gRPC's threads answer the pings, so its Watch
    stays open, its late Checks leave it in, and a call sent meanwhile is answered late, not a 503."""
    process, channels = decoder
    await _generate(channels)
    os.kill(process.pid, signal.SIGUSR1)
    await asyncio.sleep(0.2)  # the signal taken: the loop held
    call = asyncio.ensure_future(_generate(channels))
    end = time.monotonic() + HOLD_S
    while time.monotonic() < end:
        assert channels.targets, "the held decoder was taken out"
        await asyncio.sleep(0.05)
    await asyncio.wait_for(call, timeout=10)
    assert channels.targets
