"""The gateway watches each decoder replica's health once for all its callers, and each caller's own
channel balances over the replicas that serve: a replica that is not serving gets none of their
calls, one that turns SERVING gets its share, and however many callers there are, a replica sees one
Watch stream from the gateway, so one address's share of Watch streams (256) never refuses them; a
Watch refused there (others behind the gateway's address holding the share) leaves the replicas'
health known by Check and the gateway's /health and model info served."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.client.channel import ChannelSecurity
from tandem.client.errors import ConfigError, Unavailable
from tandem.client.pb.tandem.v1 import decoder_pb2, decoder_pb2_grpc, encoder_pb2
from tandem.common.server import RunningServer, ServerOptions, Service, start_server
from tandem.gateway.callers import CallerChannels, decoder_channels, model_check_metadata
from tandem.gateway.config import GatewayConfig
from tandem.gateway.replicas import Replicas

from .eventually import eventually
from .fake_decoder import FakeDecoder
from .live_gateway import live_gateway
from .stoppable_health import StoppableHealth, serve_stoppable

NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVING = health_pb2.HealthCheckResponse.SERVING


class CountingDecoder(FakeDecoder):
    """The fake decoder, counting the GetModelInfo calls it answered (the gateway's watch asks each
    replica's model as it turns SERVING: `_asked_models`)."""

    num_infos: int = 0
    model: str = "fake-model"  # the model it says it serves
    info_delay_s: float = 0.0  # how long its GetModelInfo takes (a replica busy or stopped)
    sample: encoder_pb2.TokenTableSample | None = None  # its token table's; None: a decoder from before
    weights: tuple[decoder_pb2.WeightSample, ...] = ()  # its later weights'; none: a decoder from before
    fail_infos: bool = False  # its GetModelInfo fails (with `failure`), counted in num_failed_infos
    failure: grpc.StatusCode = grpc.StatusCode.INTERNAL
    num_failed_infos: int = 0
    info_gate: asyncio.Event | None = None  # its GetModelInfo waits for it (a replica slow to answer)

    async def GetModelInfo(
        self, request: decoder_pb2.DecoderGetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> decoder_pb2.DecoderGetModelInfoResponse:
        if self.fail_infos:
            self.num_failed_infos += 1
            await context.abort(self.failure, "a hiccup")
        self.num_infos += 1
        await asyncio.sleep(self.info_delay_s)
        if self.info_gate is not None:
            await self.info_gate.wait()
        reply = await super().GetModelInfo(request, context)
        reply.model = self.model
        if self.sample is not None:
            reply.token_table_sample.CopyFrom(self.sample)
        reply.weight_samples.extend(self.weights)
        return reply


# Two checkpoints of one shape with other weights (a fine-tune beside its base), as decoders report them.
BASE = encoder_pb2.TokenTableSample(vocab_size=1024, hidden_size=64, values=[i / 128 for i in range(128)])
TUNED = encoder_pb2.TokenTableSample(vocab_size=1024, hidden_size=64, values=[-i / 128 for i in range(128)])
# A tune that kept BASE's table (a merged LoRA): its last layer's down_proj moved.
DOWN = decoder_pb2.WeightSample(
    name="model.layers.1.mlp.down_proj.weight", rows=64, columns=256, values=BASE.values
)
DOWN_TUNED = decoder_pb2.WeightSample(name=DOWN.name, rows=64, columns=256, values=TUNED.values)


async def _start_decoder(
    port: int = 0, auth_tokens: frozenset[str] = frozenset()
) -> tuple[CountingDecoder, RunningServer]:
    """A decoder as `tandem serve decoder` serves it (bounded health, 600 places for calls, 300 for
    Watch streams), SERVING, on 127.0.0.1 and ::1: two addresses on one machine."""
    decoder = CountingDecoder()
    service = Service("tandem.v1.Decoder", decoder, decoder_pb2_grpc.add_DecoderServicer_to_server)
    running = await start_server(
        ServerOptions(host="localhost", port=port, max_concurrent_rpcs=600, auth_tokens=auth_tokens),
        [service],
    )
    running.health.max_wait_s = 0.05  # a Watch past a bound is refused at once, as the tests hold it
    await running.set_serving()
    return decoder, running


@pytest.fixture
async def replicas() -> AsyncIterator[list[tuple[CountingDecoder, RunningServer]]]:
    """Two decoders (`_start_decoder`)."""
    started = []
    try:
        for _ in range(2):
            started.append(await _start_decoder())
        yield started
    finally:
        await asyncio.gather(*(running.stop(0) for _, running in started))


def _asked_models(*decoders: CountingDecoder) -> None:
    """The GetModelInfo calls of the gateway's watch, asking each replica's model as it turned SERVING,
    not counted: call once the replicas are seen serving (a replica's model is known by then)."""
    for decoder in decoders:
        decoder.num_infos = 0


def _num_serving(channels: CallerChannels) -> int:
    """Replicas the gateway has seen SERVING (where it knows of none, it balances over all)."""
    return len(channels.replicas.serving)


async def _call(channels: CallerChannels, caller: str) -> None:
    async with channels.stub(caller) as stub:
        await stub.GetModelInfo(decoder_pb2.DecoderGetModelInfoRequest(), timeout=30)


def _gateway_channels(servers: list[RunningServer], max_idle: int = 64) -> CallerChannels:
    address = ",".join(f"127.0.0.1:{running.port}" for running in servers)
    return decoder_channels(GatewayConfig(decoder_address=address, max_idle_channels=max_idle))


@pytest.mark.parametrize(
    ("address", "why"),
    [
        ("dns://8.8.8.8/decoder:50052", r"names a DNS server \(8\.8\.8\.8\).*write dns:///decoder:50052"),
        ("dns:///decoder:http", "port 'http' is not a port"),
        ("dns:///decoder:70000", "port '70000' is not a port"),
        ("dns:///:50052", "names no host"),
        ("dns:///[::1", "names no host"),
        # Watched before as names no resolver finds (or 443, for "[::1]:"), where the clients' reading
        # (`tandem.client.addresses.dns_name`, one for both) named no server for them.
        ("dns:///decoder host:50052", "'decoder host' is not a host name"),
        ("dns:///[::1]:", "port '' is not a port"),
        # Digits of other scripts are digits to str.isdigit: '²' failed int(), '٨٠' was taken as 80.
        ("dns:///decoder:²", "port '²' is not a port"),
        ("dns:///decoder:٨٠", "port '٨٠' is not a port"),
        # A list is resolved once at start (`channel_target`): an entry that does not resolve failed
        # the start with a ValueError traceback.
        ("127.0.0.1:1,nohost.invalid:2", "nohost.invalid does not resolve"),
        ("127.0.0.1:1,[::1]:2", "mixes IPv4 and IPv6"),
    ],
)
def test_an_address_the_gateway_cannot_use_is_refused_at_start_naming_the_field(
    address: str, why: str
) -> None:
    """Each dns: name here left a resolver task that died unseen (an assert, for a name it could not
    read) or logged a failure every 5 s for ever (no port), or watched other replicas than gRPC's own
    channel would (a DNS server of its own, ignored)."""
    with pytest.raises(ConfigError, match=why) as refused:
        GatewayConfig(decoder_address=address)
    assert refused.value.field == "decoder_address"


async def test_a_watcher_that_fails_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    """A resolver or watcher task nobody awaits until the gateway stops: its failure is logged when
    it fails, not lost with the task."""

    def open_channel(replica: str) -> grpc.aio.Channel:
        raise RuntimeError(f"no channel to {replica}")

    replicas = Replicas("127.0.0.1:1,127.0.0.1:2", open_channel, "tandem.v1.Decoder")
    with caplog.at_level(logging.ERROR, logger="tandem.gateway.replicas"):
        replicas.start()
        await eventually(lambda: len(caplog.records) == 2)
    await replicas.close()
    assert {record.exc_info[1].args[0] for record in caplog.records if record.exc_info} == {
        "no channel to 127.0.0.1:1",
        "no channel to 127.0.0.1:2",
    }
    assert all("127.0.0.1:1,127.0.0.1:2" in record.getMessage() for record in caplog.records)


@pytest.mark.parametrize("form", ["dns:///localhost:{port}", "dns:localhost:{port}"])
async def test_a_dns_name_is_watched_at_each_address_it_resolves_to(
    replicas: list[tuple[CountingDecoder, RunningServer]], form: str
) -> None:
    (a, server_a), _ = replicas
    config = GatewayConfig(decoder_address=form.format(port=server_a.port))
    channels = decoder_channels(config)
    try:
        assert channels.targets == (config.decoder_address,)  # the name itself, until it resolves
        await eventually(lambda: channels.targets == (f"127.0.0.1:{server_a.port}",))
        await eventually(lambda: _num_serving(channels) == 1)  # its model known: the watch asked it
        _asked_models(a)
        await _call(channels, "peer:1")
        assert a.num_infos == 1
    finally:
        await channels.close()


async def test_callers_go_to_the_serving_replicas_only_and_to_one_that_turns_serving(
    replicas: list[tuple[CountingDecoder, RunningServer]],
) -> None:
    (a, server_a), (b, server_b) = replicas
    await server_b.health.set("tandem.v1.Decoder", NOT_SERVING)  # loading, or its engine failed
    channels = _gateway_channels([server_a, server_b])
    try:
        await eventually(lambda: channels.targets == (f"127.0.0.1:{server_a.port}",))
        await eventually(lambda: _num_serving(channels) == 1)  # its model known: the watch asked it
        _asked_models(a)
        for caller in range(8):
            for _ in range(2):
                await _call(channels, f"peer:{caller}")
        assert (a.num_infos, b.num_infos) == (16, 0)

        await server_b.set_serving()
        await eventually(lambda: _num_serving(channels) == 2)
        _asked_models(b)
        # Each caller's channel over A alone is replaced by one over both. Round-robin over the
        # replicas READY: a caller's first calls may all find B still connecting (on loaded cores, a
        # round's 4), so rounds go on until B has answered 8.
        async with asyncio.timeout(10):
            while b.num_infos < 8:
                for caller in range(8):
                    for _ in range(4):
                        await _call(channels, f"peer:{caller}")
    finally:
        await channels.close()


async def test_a_draining_replica_is_left_at_once_and_no_call_fails(
    replicas: list[tuple[CountingDecoder, RunningServer]],
) -> None:
    (a, server_a), (b, server_b) = replicas
    channels = _gateway_channels([server_a, server_b])
    try:
        await eventually(lambda: _num_serving(channels) == 2)
        await asyncio.gather(*(_call(channels, f"peer:{caller}") for caller in range(8)))
        stopping = asyncio.ensure_future(server_b.stop(30))  # health NOT_SERVING, then GOAWAY
        await eventually(lambda: channels.targets == (f"127.0.0.1:{server_a.port}",))
        num_b = b.num_infos
        await asyncio.gather(*(_call(channels, f"peer:{caller}") for caller in range(8) for _ in range(2)))
        assert b.num_infos == num_b
        # Nothing of the gateway's holds B's drain: a Watch kept open did, for the whole 30 s.
        await asyncio.wait_for(stopping, 5)
    finally:
        await channels.close()


async def test_an_attacker_holding_its_share_of_watches_leaves_600_gateway_callers_served(
    replicas: list[tuple[CountingDecoder, RunningServer]],
) -> None:
    """600 callers, each on a channel of its own (the gateway at --max-connections 512 plus idle
    ones), all from 127.0.0.1, while a caller with no token asks every Watch place (300) of both
    replicas from ::1. Each replica sees the gateway's one Watch; with a Watch on each caller's
    channel, 600 from one address, the 257th caller's calls failed UNAVAILABLE ("health check call
    failed") past the share, and past the attacker's streams without it."""
    attackers = []
    for _, running in replicas:
        attacker = grpc.aio.insecure_channel(f"[::1]:{running.port}")
        attackers.append(attacker)
        stub = health_pb2_grpc.HealthStub(attacker)
        asked = [stub.Watch(health_pb2.HealthCheckRequest(), timeout=60) for _ in range(300)]
        await asyncio.gather(*(stream.read() for stream in asked), return_exceptions=True)
        assert running.health.num_watches == 256
    channels = _gateway_channels([running for _, running in replicas], max_idle=600)
    try:
        await eventually(lambda: _num_serving(channels) == 2)
        _asked_models(*(decoder for decoder, _ in replicas))
        await asyncio.gather(*(_call(channels, f"peer:{caller}") for caller in range(600)))
        assert channels.num_channels == 600
        assert sum(decoder.num_infos for decoder, _ in replicas) == 600
        for _, running in replicas:
            assert running.health.num_watches_of(f"ipv4:127.0.0.1:{running.port}") == 1
    finally:
        await channels.close()
        await asyncio.gather(*(attacker.close() for attacker in attackers))


async def _hold_watch_share(running: RunningServer, address: str) -> grpc.aio.Channel:
    """A caller with no token asks 300 Watch streams of `running` from `address` and holds the 256
    it gets, one address's share; close the channel returned to let them go."""
    attacker = grpc.aio.insecure_channel(address)
    stub = health_pb2_grpc.HealthStub(attacker)
    asked = [stub.Watch(health_pb2.HealthCheckRequest(), timeout=60) for _ in range(300)]
    await asyncio.gather(*(stream.read() for stream in asked), return_exceptions=True)
    assert running.health.num_watches == 256
    return attacker


async def test_an_attacker_on_the_gateways_own_address_leaves_its_health_and_models_served(
    replicas: list[tuple[CountingDecoder, RunningServer]],
) -> None:
    """A caller with no token holding the Watch share of the gateway's own address on both replicas
    (behind the same NAT, on the same host or k8s node's /64, or a mesh's one source address). The
    gateway's watch of each replica is refused, so it asks Check; its own decoder client watches
    nothing. With that client health-checked and a refusal RESOURCE_EXHAUSTED (before 5944202 and
    55af4b9), a freshly started gateway answered /health, /v1/models and completions 503 "health check
    call failed" for as long as the attacker held on."""
    attackers = [await _hold_watch_share(running, f"127.0.0.1:{running.port}") for _, running in replicas]
    address = ",".join(f"127.0.0.1:{running.port}" for _, running in replicas)
    try:
        async with live_gateway(address) as url, aiohttp.ClientSession() as session:
            base = url.removesuffix("/v1")

            async def health_status() -> int:
                async with session.get(base + "/health") as response:
                    return response.status

            async with asyncio.timeout(10):  # until the first Check of each replica is answered
                while await health_status() != 200:
                    await asyncio.sleep(0.05)
            async with session.get(url + "/models") as response:
                assert response.status == 200, await response.text()
                assert [card["id"] for card in (await response.json())["data"]] == ["fake-model"]
            body = {"model": "fake-model", "prompt": "hi", "max_tokens": 2}
            async with session.post(url + "/completions", json=body) as response:
                assert response.status == 200, await response.text()
        for _, running in replicas:  # the gateway's Watch was refused: no place of the attacker's taken
            assert running.health.num_watches_of(f"ipv4:127.0.0.1:{running.port}") == 256
    finally:
        await asyncio.gather(*(attacker.close() for attacker in attackers))


async def test_the_gateways_own_model_info_calls_go_to_the_replicas_seen_serving_only(
    replicas: list[tuple[CountingDecoder, RunningServer]],
) -> None:
    """/v1/models (asked each time) and the first model-info lookup of a completion go to the replicas
    the gateway's watch has seen serve. Over the gateway's own decoder client, which watches none, a
    loading or failed replica (its GetModelInfo UNAVAILABLE) got its share: 26 of 60 failed."""
    (a, server_a), (b, server_b) = replicas
    await server_b.health.set("tandem.v1.Decoder", NOT_SERVING)  # loading, or its engine failed
    address = ",".join(f"127.0.0.1:{running.port}" for running in (server_a, server_b))
    async with live_gateway(address) as url, aiohttp.ClientSession() as session:

        async def health_status() -> int:
            async with session.get(url.removesuffix("/v1") + "/health") as response:
                return response.status

        async with asyncio.timeout(10):  # until the gateway's watch has seen A serve
            while await health_status() != 200:
                await asyncio.sleep(0.05)
        for _ in range(8):
            async with session.get(url + "/models") as response:
                assert response.status == 200, await response.text()
        body = {"model": "fake-model", "prompt": "hi", "max_tokens": 2}
        async with session.post(url + "/completions", json=body) as response:
            assert response.status == 200, await response.text()
    assert b.num_infos == 0 and a.num_infos >= 9, (a.num_infos, b.num_infos)


async def test_a_replica_killed_and_started_again_on_its_port_is_seen_serving_again(
    replicas: list[tuple[CountingDecoder, RunningServer]],
) -> None:
    (_, server_a), (_, server_b) = replicas
    channels = _gateway_channels([server_a, server_b])
    replica_b = f"127.0.0.1:{server_b.port}"
    restarted: RunningServer | None = None
    try:
        await eventually(lambda: _num_serving(channels) == 2)
        await server_b.stop(0)
        await eventually(lambda: channels.targets == (f"127.0.0.1:{server_a.port}",))
        b, restarted = await _start_decoder(server_b.port)
        await eventually(lambda: _num_serving(channels) == 2, timeout_s=15)  # reconnect backoff: 5 s at most
        assert replica_b in channels.targets
        # Round-robin over the replicas READY: while B's new connections come up, a round's 16 calls
        # may all go to A (2 runs of 4 under load), so rounds go on until B answers one.
        async with asyncio.timeout(10):
            while not b.num_infos:
                await asyncio.gather(
                    *(_call(channels, f"peer:{caller}") for caller in range(8) for _ in range(2))
                )
                await asyncio.sleep(0.05)
    finally:
        await channels.close()
        if restarted is not None:
            await restarted.stop(0)


@pytest.fixture
async def stoppable() -> AsyncIterator[tuple[StoppableHealth, str]]:
    """A `StoppableHealth` served on 127.0.0.1, and its address."""
    async with serve_stoppable() as served:
        yield served


async def test_the_only_serving_replica_whose_check_is_late_stays_a_target(
    stoppable: tuple[StoppableHealth, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A late Check of the one replica that serves (a decoder's loop held a few seconds) keeps it:
    taken out, the gateway answered 503 to calls its decoder would have answered late (50 of 70 over a
    decoder frozen 3.5 s of every 4.5 s). Its Watch or a Check saying NOT_SERVING still takes it out."""
    monkeypatch.setattr("tandem.gateway.replica_health.CHECK_INTERVAL_S", 0.02)
    monkeypatch.setattr("tandem.gateway.replica_health.CHECK_TIMEOUT_S", 0.05)
    health, only = stoppable
    watched = Replicas(only, grpc.aio.insecure_channel, "tandem.v1.Decoder")
    watched.start()
    try:
        await eventually(lambda: watched.serving == (only,))
        health.running.clear()  # its loop held
        await asyncio.sleep(0.5)  # 7 Checks late
        assert watched.serving == (only,)
        assert watched.targets == (only,)
    finally:
        await watched.close()


async def test_of_two_replicas_whose_checks_are_late_one_stays_a_target(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Both replicas late: the first found late is left while the other serves, the other is then the
    only one serving and stays: callers are never refused for late Checks alone."""
    monkeypatch.setattr("tandem.gateway.replica_health.CHECK_INTERVAL_S", 0.02)
    monkeypatch.setattr("tandem.gateway.replica_health.CHECK_TIMEOUT_S", 0.05)
    async with contextlib.AsyncExitStack() as stack:
        served = [await stack.enter_async_context(serve_stoppable()) for _ in range(2)]
        addresses = [address for _, address in served]
        watched = Replicas(",".join(addresses), grpc.aio.insecure_channel, "tandem.v1.Decoder")
        watched.start()
        try:
            await eventually(lambda: watched.serving == tuple(addresses))
            for health, _ in served:
                health.running.clear()
            await eventually(lambda: len(watched.serving) == 1)
            await asyncio.sleep(0.5)
            assert len(watched.targets) == 1
        finally:
            await watched.close()


async def _restart_as(decoder: CountingDecoder, running: RunningServer, model: str) -> None:
    """`decoder` restarted serving `model`, as a rolling upgrade does: not serving, then serving."""
    await running.health.set("tandem.v1.Decoder", NOT_SERVING)
    await asyncio.sleep(0.05)
    decoder.model = model
    await running.set_serving()


async def test_a_replica_of_another_model_gets_no_calls_and_a_rolling_upgrade_moves_the_model(
    replicas: list[tuple[CountingDecoder, RunningServer]], caplog: pytest.LogCaptureFixture
) -> None:
    """Mixed replicas answered one model's name with two models' tokens, and after a rolling upgrade
    the gateway kept the first model's name. Each replica is asked its model as it turns SERVING:
    one of another model than most (ties: the model served so far) is left out, logged with its
    address; once most serve the new model, that is the gateway's."""
    (a, server_a), (b, server_b) = replicas
    replica_a, replica_b = (f"127.0.0.1:{running.port}" for running in (server_a, server_b))
    await server_b.health.set("tandem.v1.Decoder", NOT_SERVING)
    b.model = "other-model"
    channels = _gateway_channels([server_a, server_b])
    replicas_seen = channels.replicas
    assert replicas_seen is not None
    try:
        await eventually(lambda: channels.targets == (replica_a,))
        with caplog.at_level(logging.ERROR, logger="tandem.gateway.replicas"):
            await server_b.set_serving()
            await eventually(lambda: replicas_seen.mismatched == {replica_b: "other-model"})
        assert channels.targets == (replica_a,) and replicas_seen.model == "fake-model"
        assert replica_b in caplog.text and "'other-model'" in caplog.text

        await _restart_as(a, server_a, "other-model")  # the upgrade's second replica
        await eventually(lambda: _num_serving(channels) == 2)
        assert replicas_seen.model == "other-model" and not replicas_seen.mismatched
    finally:
        await channels.close()


async def test_restarting_the_replica_of_the_gateways_model_in_a_1_vs_1_pair_keeps_its_model(
    replicas: list[tuple[CountingDecoder, RunningServer]],
) -> None:
    """A (the gateway's model) and B (another, left out): A restarting with its model made B the
    majority for the restart's seconds, so the gateway moved to B's model and left A out for good, its
    callers given B's tokens. A replica restarting counts for the model it said last: the gateway keeps
    A's model, and while A does not serve, its callers get the gateway's 503 (Unavailable), never B."""
    (a, running_a), (b, _) = replicas
    b.model = "other-model"
    channels, replica_a, replica_b = await _mixed(replicas)
    seen = channels.replicas
    assert seen is not None
    try:
        await eventually(lambda: seen.mismatched == {replica_b: "other-model"})
        await running_a.health.set("tandem.v1.Decoder", NOT_SERVING)
        await eventually(lambda: replica_a not in seen.serving)
        assert seen.model == "fake-model" and seen.mismatched == {replica_b: "other-model"}
        assert channels.targets == ()
        _asked_models(a, b)
        with pytest.raises(Unavailable, match="no decoder replica serves model 'fake-model'"):
            await _call(channels, "peer:a caller")
        assert (a.num_infos, b.num_infos) == (0, 0)

        await running_a.set_serving()  # back, with the same model
        await eventually(lambda: seen.serving == (replica_a,), timeout_s=10)  # its watch's backoff
        assert seen.model == "fake-model" and seen.mismatched == {replica_b: "other-model"}
        assert channels.targets == (replica_a,)
    finally:
        await channels.close()


async def _first_upgraded(
    replicas: list[tuple[CountingDecoder, RunningServer]],
) -> tuple[CallerChannels, Replicas]:
    """The gateway's channels over 2 replicas of fake-model, and their `Replicas`, once the first has
    restarted on new-model, left out on the tie: a 2-replica rolling upgrade's first half."""
    (a, server_a), (_, server_b) = replicas
    channels = _gateway_channels([server_a, server_b])
    seen = channels.replicas
    assert seen is not None
    try:
        await eventually(lambda: _num_serving(channels) == 2)
        await _restart_as(a, server_a, "new-model")
        await eventually(lambda: seen.mismatched == {f"127.0.0.1:{server_a.port}": "new-model"})
    except BaseException:
        await channels.close()
        raise
    return channels, seen


async def test_a_replica_whose_model_ask_failed_after_its_restart_is_asked_again_and_gets_no_calls_meanwhile(
    replicas: list[tuple[CountingDecoder, RunningServer]],
) -> None:
    """A 2-replica upgrade whose second replica's ask failed once as it came back: asked once, it kept
    counting for the old model for good, the gateway stayed on it with the first replica (on the new
    one) left out, and calls went to the second under the old model's name. It is asked again; until
    it answers it gets no calls (503) and still counts for the model it said (the gateway's stays)."""
    (_, _), (b, server_b) = replicas
    channels, seen = await _first_upgraded(replicas)
    try:
        b.fail_infos = True
        await _restart_as(b, server_b, "new-model")
        await eventually(lambda: b.num_failed_infos >= 2)  # asked again (MIN_RETRY_S later)
        assert seen.model == "fake-model" and seen.targets == () and not seen.serving
        with pytest.raises(Unavailable):
            await _call(channels, "peer:a caller")

        b.fail_infos = False
        await eventually(lambda: _num_serving(channels) == 2)  # its backoff: 1.6 s at most by now
        assert seen.model == "new-model" and not seen.mismatched
    finally:
        await channels.close()


async def test_a_replica_back_on_another_model_gets_no_calls_while_its_model_is_asked(
    replicas: list[tuple[CountingDecoder, RunningServer]],
) -> None:
    """While no replica served the gateway's model, calls went to every replica not left out: one
    back on the upgrade's model, its model still being asked (or its watch in its backoff), answered
    them under the old model's name. The gateway answers 503 itself until a replica serves its model."""
    (_, _), (b, server_b) = replicas
    channels, seen = await _first_upgraded(replicas)
    try:
        b.info_gate = asyncio.Event()
        await server_b.health.set("tandem.v1.Decoder", NOT_SERVING)
        await eventually(lambda: not seen.serving)
        assert seen.targets == ()  # b restarting: it may come back on another model before it is seen
        b.model = "new-model"
        _asked_models(b)
        await server_b.set_serving()
        await eventually(lambda: b.num_infos == 1)  # seen serving, its model being asked
        assert seen.targets == ()
        with pytest.raises(Unavailable):
            await _call(channels, "peer:a caller")
        b.info_gate.set()
        await eventually(lambda: _num_serving(channels) == 2)
        assert seen.model == "new-model"
    finally:
        await channels.close()


async def test_a_replica_left_out_that_flaps_is_logged_at_error_once(
    replicas: list[tuple[CountingDecoder, RunningServer]], caplog: pytest.LogCaptureFixture
) -> None:
    """Each flap of a replica left out (not serving, then serving its model again) logged it at ERROR
    again; it is logged again only where it comes back with another model."""
    (_, _), (b, server_b) = replicas
    b.model = "other-model"
    with caplog.at_level(logging.ERROR, logger="tandem.gateway.replicas"):
        channels, _, replica_b = await _mixed(replicas)
        seen = channels.replicas
        assert seen is not None
        try:
            await eventually(lambda: seen.mismatched == {replica_b: "other-model"})
            for _ in range(2):
                _asked_models(b)
                await server_b.health.set("tandem.v1.Decoder", NOT_SERVING)
                await eventually(lambda: not seen.mismatched)
                await server_b.set_serving()
                await eventually(lambda: seen.mismatched == {replica_b: "other-model"} and b.num_infos == 1)
            await _restart_as(b, server_b, "third-model")
            await eventually(lambda: seen.mismatched == {replica_b: "third-model"})
        finally:
            await channels.close()
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 2 and "'other-model'" in errors[0] and "'third-model'" in errors[1], errors


async def test_the_gateway_names_a_replica_of_another_model_in_health_and_follows_an_upgrade(
    replicas: list[tuple[CountingDecoder, RunningServer]],
) -> None:
    """/health names a replica left out for its model; the gateway's model (/v1/models, a
    completion's base model) is asked again as the replicas serving change: it was asked once, so
    after a rolling upgrade every request for the new model was a 404 until the gateway restarted."""
    (a, server_a), (b, server_b) = replicas
    await server_b.health.set("tandem.v1.Decoder", NOT_SERVING)
    address = ",".join(f"127.0.0.1:{running.port}" for running in (server_a, server_b))
    async with live_gateway(address) as url, aiohttp.ClientSession() as session:

        async def get(path: str) -> tuple[int, dict[str, Any]]:
            async with session.get(url.removesuffix("/v1") + path) as response:
                return response.status, await response.json()

        async with asyncio.timeout(10):
            while (await get("/health"))[0] != 200:
                await asyncio.sleep(0.05)
        assert (await get("/v1/models"))[1]["data"][0]["id"] == "fake-model"
        b.model = "new-model"
        await server_b.set_serving()
        async with asyncio.timeout(5):
            while "other_models" not in (health := (await get("/health"))[1]):
                await asyncio.sleep(0.05)
        assert health == {
            "status": "ok",
            "replicas": {"serving": 1, "watched": 2},  # "ok" while one serves: how many is said
            "model": "fake-model",
            "other_models": [{"replica": f"127.0.0.1:{server_b.port}", "model": "new-model"}],
        }
        await _restart_as(a, server_a, "new-model")
        async with asyncio.timeout(5):  # a 503 while neither serves fake-model nor is new-model's yet
            while (await get("/v1/models"))[1].get("data", [{}])[0].get("id") != "new-model":
                await asyncio.sleep(0.05)
        body = {"model": "new-model", "prompt": "hi", "max_tokens": 2}
        async with session.post(url + "/completions", json=body) as response:
            assert response.status == 200, await response.text()
            assert (await response.json())["model"] == "new-model"
        async with asyncio.timeout(5):  # a, restarted, serves once its model is asked
            while (await get("/health"))[1] != {"status": "ok", "replicas": {"serving": 2, "watched": 2}}:
                await asyncio.sleep(0.05)


async def test_one_decoder_restarted_with_another_model_is_followed_within_the_info_age(
    replicas: list[tuple[CountingDecoder, RunningServer]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """One decoder (no watch) restarted with another model: the gateway's model info, asked once,
    kept the old name until the gateway restarted; it is asked again past decoder_info.MAX_AGE_S."""
    monkeypatch.setattr("tandem.gateway.decoder_info.MAX_AGE_S", 0.0)
    (a, server_a), _ = replicas
    async with live_gateway(f"127.0.0.1:{server_a.port}") as url, aiohttp.ClientSession() as session:

        async def completion_model() -> str:
            body = {"prompt": "hi", "max_tokens": 2}
            async with session.post(url + "/completions", json=body) as response:
                assert response.status == 200, await response.text()
                return (await response.json())["model"]

        assert await completion_model() == "fake-model"
        a.model = "new-model"
        # A stale answer is served while its refresh runs beside the requests (never on their path).
        async with asyncio.timeout(5):
            while await completion_model() != "new-model":
                await asyncio.sleep(0.05)


async def test_a_stale_model_info_is_served_while_its_refresh_waits_on_a_slow_replica(
    replicas: list[tuple[CountingDecoder, RunningServer]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The refresh runs beside the requests: asked on their path under one lock, a refresh that reached
    a replica stopped or busy held every completion behind it (4-10 s), one of them a 504 at 10 s."""
    monkeypatch.setattr("tandem.gateway.decoder_info.MAX_AGE_S", 0.0)
    (a, server_a), _ = replicas
    async with live_gateway(f"127.0.0.1:{server_a.port}") as url, aiohttp.ClientSession() as session:

        async def completion_seconds() -> float:
            started = time.monotonic()
            body = {"prompt": "hi", "max_tokens": 2}
            async with session.post(url + "/completions", json=body) as response:
                assert response.status == 200, await response.text()
                assert (await response.json())["model"] == "fake-model"
            return time.monotonic() - started

        await completion_seconds()  # the first answer is waited for: there is nothing to serve before it
        a.info_delay_s = 8.0
        seconds = await asyncio.gather(*(completion_seconds() for _ in range(4)))
        assert max(seconds) < 4.0, seconds  # milliseconds each, on loaded cores well under the 8 s


async def _mixed(
    replicas: list[tuple[CountingDecoder, RunningServer]], config: GatewayConfig | None = None
) -> tuple[CallerChannels, str, str]:
    """The gateway's channels over `replicas` (over `config`'s settings), once the first serves alone
    and the second (NOT_SERVING till then) turns SERVING; the first's and the second's address."""
    (_, server_a), (_, server_b) = replicas
    replica_a, replica_b = (f"127.0.0.1:{running.port}" for running in (server_a, server_b))
    await server_b.health.set("tandem.v1.Decoder", NOT_SERVING)
    config = config or GatewayConfig()
    channels = decoder_channels(dataclasses.replace(config, decoder_address=f"{replica_a},{replica_b}"))
    await eventually(lambda: channels.targets == (replica_a,))
    await server_b.set_serving()
    return channels, replica_a, replica_b


async def test_a_replica_of_another_checkpoint_under_the_models_name_gets_no_calls_logged_with_both(
    replicas: list[tuple[CountingDecoder, RunningServer]], caplog: pytest.LogCaptureFixture
) -> None:
    """Two decoders over checkpoints of one shape under one --model-name reported the same name, hidden
    size and vocabulary: the callers' requests were answered by either checkpoint. Their token table
    samples differ: the second is another model, logged naming both replicas."""
    (a, _), (b, _) = replicas
    a.sample, b.sample = BASE, TUNED
    with caplog.at_level(logging.ERROR, logger="tandem.gateway.replicas"):
        channels, replica_a, replica_b = await _mixed(replicas)
        await eventually(lambda: bool(channels.replicas.mismatched))
    try:
        assert channels.replicas.model == "fake-model" and list(channels.replicas.mismatched) == [replica_b]
        assert channels.targets == (replica_a,)
        assert f"decoder replica {replica_b} serves model 'fake-model' from another checkpoint" in caplog.text
        assert f"(served by {replica_a})" in caplog.text
    finally:
        await channels.close()


@pytest.mark.parametrize(
    ("samples", "weights", "differs"),
    [
        ((BASE, TUNED), ((), ()), "token_table_sample"),
        ((BASE, BASE), ((DOWN,), (DOWN_TUNED,)), "weight_samples"),  # a tune that kept the table
    ],
)
async def test_health_names_a_replica_of_another_checkpoint_under_the_models_name_and_what_differs(
    replicas: list[tuple[CountingDecoder, RunningServer]],
    samples: tuple[encoder_pb2.TokenTableSample, encoder_pb2.TokenTableSample],
    weights: tuple[tuple[decoder_pb2.WeightSample, ...], tuple[decoder_pb2.WeightSample, ...]],
    differs: str,
) -> None:
    (a, _), (b, server_b) = replicas
    (a.sample, b.sample), (a.weights, b.weights) = samples, weights
    await server_b.health.set("tandem.v1.Decoder", NOT_SERVING)
    address = ",".join(f"127.0.0.1:{running.port}" for _, running in replicas)
    async with live_gateway(address) as url, aiohttp.ClientSession() as session:
        health_url = url.removesuffix("/v1") + "/health"
        async with asyncio.timeout(5):
            while (await (await session.get(health_url)).json())["status"] != "ok":
                await asyncio.sleep(0.05)
            await server_b.set_serving()
            while "other_models" not in (health := await (await session.get(health_url)).json()):
                await asyncio.sleep(0.05)
    assert health == {
        "status": "ok",
        "replicas": {"serving": 1, "watched": 2},
        "model": "fake-model",
        "other_models": [
            {"replica": f"127.0.0.1:{server_b.port}", "model": "fake-model", differs: "differs"}
        ],
    }


async def test_replicas_of_one_checkpoint_and_an_older_decoder_of_its_name_all_serve(
    replicas: list[tuple[CountingDecoder, RunningServer]],
) -> None:
    """Samples that agree are one model; a decoder from before the sample (none reported) is compared
    by its name alone, as before."""
    (a, _), (b, server_b) = replicas
    a.sample = b.sample = BASE
    channels, replica_a, replica_b = await _mixed(replicas)
    try:
        await eventually(lambda: channels.targets == (replica_a, replica_b))
        assert not channels.replicas.mismatched
        b.sample = None
        await _restart_as(b, server_b, "fake-model")
        await eventually(lambda: _num_serving(channels) == 2)
        assert not channels.replicas.mismatched
    finally:
        await channels.close()


async def test_passing_callers_tokens_on_the_gateway_still_asks_each_replicas_model() -> None:
    """A gateway that passes its callers' tokens on has no token of its own: the replicas refused its
    GetModelInfo and no replica's model was checked, another model's replica served with the rest. It
    asks with one of the tokens it accepts, the services' token file."""
    tokens = frozenset({"sekret", "other"})
    started = [await _start_decoder(auth_tokens=tokens) for _ in range(2)]
    started[1][0].model = "other-model"
    try:
        channels, replica_a, replica_b = await _mixed(started, GatewayConfig(auth_tokens=tokens))
        try:
            await eventually(lambda: bool(channels.replicas.mismatched))
            assert channels.targets == (replica_a,)
            assert channels.replicas.mismatched == {replica_b: "other-model"}
        finally:
            await channels.close()
    finally:
        await asyncio.gather(*(running.stop(0) for _, running in started))


def test_the_replicas_models_are_asked_with_the_gateways_own_token_else_one_it_accepts() -> None:
    upstream = ChannelSecurity(token="own")
    assert model_check_metadata(GatewayConfig()) is None
    assert model_check_metadata(GatewayConfig(auth_tokens=frozenset({"b", "a"}), upstream=upstream)) is None
    assert model_check_metadata(GatewayConfig(auth_tokens=frozenset({"b", "a"}))) == (
        ("authorization", "Bearer a"),
    )


async def test_each_replica_newly_left_out_is_logged_at_error_naming_it_and_both_models_and_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A replica left out kept /health "ok", was said once, and when most replicas moved to another
    model the one left behind got a WARNING naming none: each one is now an ERROR as it is left out,
    and counted (`num_left_out`, the gauge's reading)."""
    started = [await _start_decoder() for _ in range(3)]
    (a, server_a), (b, server_b), (c, server_c) = started
    addresses = [f"127.0.0.1:{running.port}" for _, running in started]
    await server_b.health.set("tandem.v1.Decoder", NOT_SERVING)
    await server_c.health.set("tandem.v1.Decoder", NOT_SERVING)
    b.model = c.model = "new-model"
    channels = _gateway_channels([server_a, server_b, server_c])
    seen = channels.replicas
    assert seen is not None
    try:
        await eventually(lambda: channels.targets == (addresses[0],))
        with caplog.at_level(logging.ERROR, logger="tandem.gateway.replicas"):
            await server_b.set_serving()  # 1 to 1: the model served so far stays, b left out
            await eventually(lambda: seen.num_left_out == 1)
            await server_c.set_serving()  # 2 to 1: the gateway moves, a is left behind
            await eventually(lambda: seen.model == "new-model" and seen.num_left_out == 1)
            await asyncio.sleep(0.05)  # nothing more is said while nothing changes
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 2, errors
        assert errors[0].startswith(
            f"decoder replica {addresses[1]} serves model 'new-model', not 'fake-model'"
        )
        assert errors[1].startswith(
            f"decoder replica {addresses[0]} serves model 'fake-model', not 'new-model'"
        )
        assert seen.num_watched == 3 and seen.mismatched == {addresses[0]: "fake-model"}
    finally:
        await channels.close()
        await asyncio.gather(*(running.stop(0) for _, running in started))


async def _restarted_failing_asks(
    replicas: list[tuple[CountingDecoder, RunningServer]], failure: grpc.StatusCode
) -> tuple[CallerChannels, Replicas]:
    """The gateway's channels over 2 replicas of fake-model, each seen serving it, then restarted on it
    with every GetModelInfo failing with `failure` (a token rotated past the gateway's; an older decoder)."""
    channels = _gateway_channels([running for _, running in replicas])
    seen = channels.replicas
    assert seen is not None
    try:
        await eventually(lambda: _num_serving(channels) == 2)
        for decoder, running in replicas:
            decoder.fail_infos, decoder.failure = True, failure
            await _restart_as(decoder, running, "fake-model")
        await eventually(lambda: all(decoder.num_failed_infos for decoder, _ in replicas))
    except BaseException:
        await channels.close()
        raise
    return channels, seen


@pytest.mark.parametrize(
    "refusal",
    [grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNIMPLEMENTED],
)
async def test_replicas_whose_model_asks_are_refused_by_their_configuration_get_calls_not_checked(
    replicas: list[tuple[CountingDecoder, RunningServer]],
    refusal: grpc.StatusCode,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Every replica restarted on the same model, the gateway's ask refused (UNAUTHENTICATED after a
    token rotation with the callers' tokens passed on): each was held back for good, the gateway 503 with
    every replica serving. A refusal no retry changes makes each not checked, logged at ERROR: it gets
    calls, as a replica never checked does, and still counts for the model it said."""
    with caplog.at_level(logging.ERROR, logger="tandem.gateway.replicas"):
        channels, seen = await _restarted_failing_asks(replicas, refusal)
        try:
            addresses = tuple(f"127.0.0.1:{running.port}" for _, running in replicas)
            await eventually(lambda: set(channels.targets) == set(addresses))
            async with channels.stub("peer:a caller"):  # a call goes out (the fake refuses GetModelInfo)
                pass
            assert set(seen.model_unknown) == set(addresses) and seen.model == "fake-model"
        finally:
            await channels.close()
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 2 and all("not checked" in e and "'fake-model'" in e for e in errors), errors


async def test_a_refused_ask_of_the_gateways_models_replica_hands_the_gateway_no_other_model(
    replicas: list[tuple[CountingDecoder, RunningServer]],
) -> None:
    """A 1-vs-1 pair, B of another model left out: A restarted and its ask refused (a token rotated) was
    not checked and its model forgotten, so B's was the only vote: the gateway moved to B's model, sent
    calls to B, and left A out for good once A answered again (a tie keeps the model so far). A replica
    not checked still counts for the model it said."""
    (a, server_a), (b, _) = replicas
    b.model = "other-model"
    channels, replica_a, replica_b = await _mixed(replicas)
    seen = channels.replicas
    assert seen is not None
    try:
        await eventually(lambda: seen.mismatched == {replica_b: "other-model"})
        a.fail_infos, a.failure = True, grpc.StatusCode.UNAUTHENTICATED
        await _restart_as(a, server_a, "fake-model")
        await eventually(lambda: a.num_failed_infos > 0 and replica_a in seen.model_unknown)
        await eventually(lambda: channels.targets == (replica_a,))  # not checked: it gets calls
        assert seen.model == "fake-model" and replica_b in seen.mismatched
        a.fail_infos = False  # the token fixed: A answers again
        await eventually(lambda: not seen.model_unknown, timeout_s=10)  # its asks' backoff: 5 s at most
        assert seen.model == "fake-model" and channels.targets == (replica_a,)
        assert seen.mismatched == {replica_b: "other-model"}
    finally:
        await channels.close()


async def test_a_replica_whose_model_asks_keep_failing_gets_calls_not_checked_past_a_bound(
    replicas: list[tuple[CountingDecoder, RunningServer]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Asks failing otherwise (a replica busy, INTERNAL) hold a replica that said a model back a while,
    the gateway's 503 saying the replicas serve but their model could not be checked; past
    UNCHECKED_AFTER_S each is not checked and gets calls."""
    monkeypatch.setattr("tandem.gateway.replicas.UNCHECKED_AFTER_S", 3600.0)
    channels, seen = await _restarted_failing_asks(replicas, grpc.StatusCode.INTERNAL)
    try:
        assert channels.targets == ()
        with pytest.raises(Unavailable, match="2 serve, but their model could not be checked"):
            await _call(channels, "peer:a caller")
        monkeypatch.setattr("tandem.gateway.replicas.UNCHECKED_AFTER_S", 0.0)  # the next failure is past it
        await eventually(lambda: len(channels.targets) == 2)
        for decoder, _ in replicas:
            decoder.fail_infos = False  # answering again: checked again
        await eventually(lambda: not seen.model_unknown, timeout_s=10)  # their asks' backoff: 5 s at most
        assert len(seen.serving) == 2 and seen.model == "fake-model"
    finally:
        await channels.close()


async def test_health_counts_the_replicas_calls_go_to_and_lists_those_whose_model_is_unknown(
    replicas: list[tuple[CountingDecoder, RunningServer]],
) -> None:
    """At a cold start, calls go to every serving replica before any has said its model, while /health
    counted only replicas whose model was checked: 503 while calls went through. It counts the replicas
    calls go to, and lists those whose model is not known."""
    for decoder, _ in replicas:
        decoder.info_gate = asyncio.Event()  # the gateway's model asks wait: a replica slow to answer
    address = ",".join(f"127.0.0.1:{running.port}" for _, running in replicas)
    async with live_gateway(address) as url, aiohttp.ClientSession() as session:
        async with asyncio.timeout(5):
            while True:
                async with session.get(url.removesuffix("/v1") + "/health") as response:
                    health = await response.json()
                if health.get("model_unknown") and health["replicas"]["watched"] == 2:
                    break
                await asyncio.sleep(0.05)
        assert response.status == 200 and health["status"] == "ok", health
        assert sorted(health["model_unknown"]) == sorted(address.split(",")) and health["model"] is None
        for decoder, _ in replicas:
            assert decoder.info_gate is not None
            decoder.info_gate.set()
