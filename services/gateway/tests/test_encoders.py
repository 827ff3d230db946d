"""Several encoder replicas behind the gateway are checked as decoder replicas are: one serving another
model than most (another checkpoint, or another embedder of one) gets no embeds, logged at ERROR naming
it; one address is one channel with the replicas' keepalive, a name a DNS server resolves one client."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from tandem.client.client import EncoderClient
from tandem.client.errors import Unavailable
from tandem.client.pb.tandem.v1 import encoder_pb2, encoder_pb2_grpc
from tandem.common.server import RunningServer, ServerOptions, Service, start_server
from tandem.gateway.config import GatewayConfig
from tandem.gateway.encoder_info import EncoderInfo
from tandem.gateway.encoders import EncoderReplicas, OneEncoder, answering, gateway_encoder

from .fake_encoder import FakeEncoder

NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def _start_encoder(embedder: str) -> tuple[FakeEncoder, RunningServer]:
    """A fake encoder of `embedder`, with the health service `tandem serve encoder` has, SERVING."""
    encoder = FakeEncoder(embedder=embedder)
    service = Service("tandem.v1.Encoder", encoder, encoder_pb2_grpc.add_EncoderServicer_to_server)
    running = await start_server(ServerOptions(host="127.0.0.1"), [service])
    await running.set_serving()
    return encoder, running


@pytest.fixture
async def three_encoders() -> AsyncIterator[list[tuple[FakeEncoder, RunningServer]]]:
    """Two token table lookups and a projector, of one model."""
    started = []
    try:
        for embedder in ("lookup", "lookup", "projector"):
            started.append(await _start_encoder(embedder))
        yield started
    finally:
        await asyncio.gather(*(running.stop(0) for _, running in started))


async def test_an_encoder_replica_of_another_embedder_gets_no_embeds_logged_naming_it(
    three_encoders: list[tuple[FakeEncoder, RunningServer]], caplog: pytest.LogCaptureFixture
) -> None:
    """`--encoder-address a,b,c` was one channel balanced over all three: the projector answered a
    third of /v1/embeddings with vectors of another embedder under one name."""
    addresses = [f"127.0.0.1:{running.port}" for _, running in three_encoders]
    with caplog.at_level(logging.ERROR, logger="tandem.gateway.replicas"):
        encoder = gateway_encoder(GatewayConfig(encoder_address=",".join(addresses)))
        assert isinstance(encoder, EncoderReplicas)
        try:
            seen = encoder.replicas
            async with asyncio.timeout(10):
                while seen.serving != tuple(addresses[:2]) or not seen.mismatched:
                    await asyncio.sleep(0.01)
            assert seen.differences == {addresses[2]: "embedder"} and seen.num_left_out == 1
            request = encoder_pb2.EmbedRequest(image=encoder_pb2.Image(data=b"picture"))
            await asyncio.gather(*(encoder.stub.Embed(request, timeout=10) for _ in range(8)))
            (a, _), (b, _), (projector, _) = three_encoders
            assert (len(a.embedded) + len(b.embedded), len(projector.embedded)) == (8, 0)
        finally:
            await encoder.close()
    assert f"encoder replica {addresses[2]} embeds for model 'fake-encoder' with a 'projector'" in caplog.text


@pytest.mark.parametrize(
    "address",
    [
        "dns://127.0.0.1:53/encoders.example:50051",
        # Spaced, as the config's check (`channel_target`) takes it: read by prefix, it was watched as
        # replicas of a name never looked up (the resolver task died on an AssertionError at start).
        " dns://127.0.0.1:53/encoders.example:50051 ",
    ],
)
async def test_a_name_a_dns_server_resolves_is_one_client_as_before(address: str) -> None:
    encoder = gateway_encoder(GatewayConfig(encoder_address=address))
    try:
        assert isinstance(encoder, EncoderClient)
    finally:
        await encoder.close()


# A fake encoder in a process of its own: a SIGSTOP stops all of it, gRPC's threads (and pings) too.
ENCODER = """
import asyncio
from tests.fake_encoder import fake_encoder
async def main():
    async with fake_encoder() as (_, address):
        print(address, flush=True)
        await asyncio.Event().wait()
asyncio.run(main())
"""


async def test_one_encoder_stopped_for_good_ends_the_embeds_sent_to_it_within_seconds() -> None:
    """One --encoder-address was an `EncoderClient`, one server's keepalive (30 s + 10 s): with the
    encoder stopped (SIGSTOP, its connection open) the embeddings sent meanwhile waited 55-60 s. Its
    channel has the replicas' keepalive (ping every 2 s, unanswered in 3 s), as one decoder's has."""
    process = subprocess.Popen(
        [sys.executable, "-c", ENCODER], cwd=Path(__file__).parents[1], stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None
    try:
        address = (await asyncio.to_thread(process.stdout.readline)).strip()
        encoder = gateway_encoder(GatewayConfig(encoder_address=address))
        try:
            assert isinstance(encoder, OneEncoder)
            request = encoder_pb2.EmbedRequest(text="hi")
            await encoder.stub.Embed(request, timeout=10)
            os.kill(process.pid, signal.SIGSTOP)
            # Latency is the promise: the call, made as the encoder stops, ends UNAVAILABLE within its
            # deadline of 20 s, counted by gRPC from the call's start. ~9.5 s idle (ping 2 s + 3 s, then
            # gRPC's delayed close: timers, which a busy CPU delays by little); the whole test, the
            # encoder's start included, 9.8-12.0 s in 10 runs beside a second copy of it. One server's
            # keepalive took 55-60 s: the deadline would end the call DEADLINE_EXCEEDED.
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await encoder.stub.Embed(request, timeout=20)
            assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            await encoder.close()
    finally:
        os.kill(process.pid, signal.SIGCONT)
        process.kill()
        process.wait()


async def _wait_for(condition: Callable[[], bool]) -> None:
    async with asyncio.timeout(5):
        while not condition():
            await asyncio.sleep(0.01)


async def test_embeds_in_flight_as_the_replicas_serving_change_are_not_cut(
    three_encoders: list[tuple[FakeEncoder, RunningServer]],
) -> None:
    """A change of the replicas serving opens a channel over the new ones; the one it replaces is closed
    once its calls end, not under them: the embeds are held until the change is made, then answered."""
    addresses = [f"127.0.0.1:{running.port}" for _, running in three_encoders[:2]]
    gate = asyncio.Event()
    for fake, _ in three_encoders[:2]:
        fake.embed_gate = gate
    encoder = gateway_encoder(GatewayConfig(encoder_address=",".join(addresses)))
    assert isinstance(encoder, EncoderReplicas)
    try:
        await _wait_for(lambda: encoder.replicas.serving == tuple(addresses))
        request = encoder_pb2.EmbedRequest(image=encoder_pb2.Image(data=b"picture"))
        embeds = [asyncio.ensure_future(encoder.stub.Embed(request, timeout=10)) for _ in range(4)]
        await _wait_for(lambda: sum(len(e.embedded) for e, _ in three_encoders[:2]) == 4)  # all under way
        await three_encoders[1][1].health.set("tandem.v1.Encoder", NOT_SERVING)
        await _wait_for(lambda: encoder.replicas.targets == (addresses[0],))
        gate.set()
        assert len(await asyncio.gather(*embeds)) == 4
        await encoder.stub.Embed(request, timeout=10)  # over the new channel
    finally:
        gate.set()
        await encoder.close()


async def test_encoder_replicas_whose_model_asks_are_refused_get_embeds_not_checked(
    three_encoders: list[tuple[FakeEncoder, RunningServer]],
) -> None:
    """Both replicas restarted on the same model with a token the gateway's ask lacks: held back for
    good, every embed was the gateway's 503. A refusal of its configuration makes each not checked."""
    two = three_encoders[:2]
    encoder = gateway_encoder(GatewayConfig(encoder_address=",".join(f"127.0.0.1:{r.port}" for _, r in two)))
    assert isinstance(encoder, EncoderReplicas)
    try:
        await _wait_for(lambda: len(encoder.replicas.serving) == 2)
        for fake, running in two:
            fake.token = "rotated"
            await _restart_as(fake, running, "fake-encoder")
        await _wait_for(
            lambda: len(encoder.replicas.targets) == 2 and len(encoder.replicas.model_unknown) == 2
        )
        request = encoder_pb2.EmbedRequest(image=encoder_pb2.Image(data=b"picture"))
        await encoder.stub.Embed(request, timeout=10)
    finally:
        await encoder.close()


async def _restart_as(encoder: FakeEncoder, running: RunningServer, model: str) -> None:
    """`encoder` restarted embedding for `model`, as a rolling upgrade does: not serving, then serving."""
    await running.health.set("tandem.v1.Encoder", NOT_SERVING)
    await asyncio.sleep(0.05)
    encoder.model = model
    await running.set_serving()


async def test_the_encoders_model_info_is_asked_again_once_its_replicas_move_to_another_model(
    three_encoders: list[tuple[FakeEncoder, RunningServer]],
) -> None:
    """The encoder's info was asked once: after both replicas moved to another model, /v1/embeddings
    still answered under the first one's name, with its bounds. It is asked again as the replicas
    called or their model change."""
    two = three_encoders[:2]
    encoder = gateway_encoder(GatewayConfig(encoder_address=",".join(f"127.0.0.1:{r.port}" for _, r in two)))
    assert isinstance(encoder, EncoderReplicas)
    info = EncoderInfo(encoder.stub, answering(encoder))
    try:
        await _wait_for(lambda: len(encoder.replicas.serving) == 2)
        assert (await info.get()).model == "fake-encoder"
        for fake, running in two:
            fake.max_image_bytes = 1234
            await _restart_as(fake, running, "new-encoder")
        await _wait_for(
            lambda: encoder.replicas.model == "new-encoder" and len(encoder.replicas.serving) == 2
        )
        answer = await info.get()
        assert (answer.model, answer.max_image_bytes) == ("new-encoder", 1234)
        asked = sum(fake.num_model_infos for fake, _ in two)
        await info.get()
        assert sum(fake.num_model_infos for fake, _ in two) == asked  # nothing changed: not asked again
    finally:
        await encoder.close()


async def test_an_embed_while_no_encoder_replica_serves_the_model_is_unavailable_at_once(
    three_encoders: list[tuple[FakeEncoder, RunningServer]],
) -> None:
    """With one replica left out on another model and the other restarting, embeds went to the one left
    out (its vectors under the other model's name): the gateway answers 503 (Unavailable) itself."""
    (a, running_a), (b, running_b) = three_encoders[:2]
    encoder = gateway_encoder(
        GatewayConfig(encoder_address=f"127.0.0.1:{running_a.port},127.0.0.1:{running_b.port}")
    )
    assert isinstance(encoder, EncoderReplicas)
    try:
        await _wait_for(lambda: len(encoder.replicas.serving) == 2)
        await _restart_as(a, running_a, "new-encoder")
        await _wait_for(lambda: encoder.replicas.num_left_out == 1)
        await running_b.health.set("tandem.v1.Encoder", NOT_SERVING)
        await _wait_for(lambda: not encoder.replicas.serving)
        request = encoder_pb2.EmbedRequest(image=encoder_pb2.Image(data=b"picture"))
        with pytest.raises(Unavailable, match="no encoder replica serves"):
            await encoder.stub.Embed(request, timeout=5)
        assert not a.embedded and not b.embedded
    finally:
        await encoder.close()
