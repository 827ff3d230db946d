"""A balanced channel that watches no health (`is_health_checked=False`, the gateway's per-caller
channels) still gets its Generate calls served while a replica answers UNAVAILABLE before taking the
call (as a loading, draining or failed decoder does) or stops: gRPC retries a Generate no server
began on the next replica, and round_robin skips a replica it cannot connect to."""

from __future__ import annotations

import asyncio
import collections
import json
from pathlib import Path

import grpc
import pytest

from common.tests.client.replica import Replica, serve_decoder
from tandem.client.channel import (
    PLAINTEXT,
    ChannelSecurity,
    channel_target,
    open_channel,
    server_of,
    service_config,
)
from tandem.client.pb.tandem.v1 import decoder_pb2, decoder_pb2_grpc
from tandem.common.server import ServerOptions, Service, start_server


async def _served_by(channel: grpc.aio.Channel, num_calls: int) -> collections.Counter[str]:
    stub = decoder_pb2_grpc.DecoderStub(channel)

    async def one() -> str:
        stream = stub.Generate(decoder_pb2.GenerateRequest(), timeout=10)
        return (await stream.read()).request_id

    return collections.Counter([await one() for _ in range(num_calls)])


def test_a_balanced_channel_watches_health_unless_told_not_to() -> None:
    watched = json.loads(service_config(is_balanced=True, health_service="tandem.v1.Decoder"))
    unwatched = json.loads(service_config(is_balanced=True))
    assert watched["healthCheckConfig"] == {"serviceName": "tandem.v1.Decoder"}
    assert unwatched["loadBalancingConfig"] == watched["loadBalancingConfig"] == [{"round_robin": {}}]
    assert "healthCheckConfig" not in unwatched


async def test_an_unwatched_balanced_channel_retries_a_refused_generate_and_skips_a_stopped_replica() -> None:
    replicas = [Replica("a"), Replica("b")]
    servers = [await serve_decoder(replica) for replica in replicas]
    channel = open_channel(
        [s.address for s in servers],
        service="tandem.v1.Decoder",
        own_connection=True,
        is_health_checked=False,
    )
    try:
        assert set(await _served_by(channel, 8)) == {"a", "b"}  # round-robin over both
        replicas[1].is_loading = True
        assert await _served_by(channel, 8) == {"a": 8}  # each refusal retried on the other
        assert replicas[1].num_refused >= 3
        replicas[1].is_loading = False
        await servers[1].stop(0)  # its connection and listener closed, as a killed or drained one's
        assert await _served_by(channel, 8) == {"a": 8}
    finally:
        await channel.close()
        await asyncio.gather(*(s.stop(0) for s in servers))


@pytest.mark.parametrize("port", ["\u0668\u0660", "\u00b2", "0", "70000", "9" * 5000])
def test_a_port_of_digits_outside_ascii_is_not_a_port(port: str) -> None:
    """'٨٠' was taken as port 80, '²' and 5,000 digits failed in int() with its own words, 0 and
    70000 were taken."""
    with pytest.raises(ValueError, match="expected host:port"):
        channel_target(f"127.0.0.1:1,127.0.0.1:{port}")


@pytest.mark.parametrize(
    "address",
    ["127.0.0.1:116328", "127.0.0.1:0", "127.0.0.1", "::::", "::1:50051", "[nope]:1", "http://x:80"],
)
def test_a_single_address_is_checked_as_a_list_s_are(address: str) -> None:
    """One address went to gRPC unchecked: port 116328 reached the server on 50792 (mod 65536), and
    "::::" waited out its deadline as a name that does not resolve."""
    with pytest.raises(ValueError, match=r"address .*: (expected host:port|\[nope\] is not)"):
        channel_target(address)


@pytest.mark.parametrize(
    "address", ["ipv4:127.0.0.1:50051", "ipv6:[::1]:50051", "unix:/run/tandem.sock", "unix-abstract:tandem"]
)
def test_grpcs_own_target_schemes_pass_as_written(address: str) -> None:
    """gRPC's naming schemes reached the server before single addresses were checked, and still do."""
    assert channel_target(address) == (address, False)


def test_an_ipv4_target_still_has_its_port_checked() -> None:
    with pytest.raises(ValueError, match="a port in 1..65535"):
        channel_target("ipv4:127.0.0.1:116328")


@pytest.mark.parametrize("address", ["decoder:50052", "127.0.0.1:1", "[::1]:65535", "no.such.invalid:1"])
def test_a_single_address_is_not_resolved(address: str) -> None:
    """A name that resolves only later (a Service not created yet) is still an address."""
    assert channel_target(address) == (address, False)


class FreezableProxy:
    """A TCP proxy in front of a server that, once `frozen`, forwards nothing more either way: a
    server process stopped (SIGSTOP, a frozen VM), whose host's kernel still holds its connections
    open and accepts new ones."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.running = asyncio.Event()
        self.running.set()
        self.address = ""
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.address = f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def close(self) -> None:
        assert self._server is not None
        self.running.set()
        self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        host, port = self.upstream.rsplit(":", 1)
        up_reader, up_writer = await asyncio.open_connection(host, int(port))
        await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer))

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                await self.running.wait()
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()


@pytest.mark.parametrize(
    ("address", "server"),
    [
        ("decoder:50052", ("decoder", 50052)),
        ("[::1]:50052", ("::1", 50052)),
        ("ipv4:10.0.0.7:50052", ("10.0.0.7", 50052)),
        ("dns:///decoder.tandem.svc:50052", ("decoder.tandem.svc", 50052)),
        ("dns://10.0.0.2/decoder:50052", ("decoder", 50052)),
        ("unix:/run/tandem.sock", ("/run/tandem.sock", None)),
        ("unix:///run/tandem.sock", ("/run/tandem.sock", None)),  # an empty authority: was '///run/...'
        ("ipv6:[fe80::1%25eth0]:50052", ("fe80::1%eth0", 50052)),  # the URI's %25 is the zone's %
        ("dns:///decoder.tandem.svc", ("decoder.tandem.svc", 443)),  # gRPC's port for it: was None
        ("dns:[::1]", ("::1", 443)),
        ("a:1,b:2", None),  # several: no one of them is the call's server
        (["a:1", "b:2"], None),
    ],
)
def test_the_server_an_address_names_is_a_single_servers_or_a_dns_names(address, server) -> None:
    assert server_of(address) == server


async def test_a_stopped_replica_is_left_within_its_keepalive_not_gRPCs_minute(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A replica stopped leaves its connection and its health Watch open and says nothing: the
    channel's round_robin kept sending it half of all new calls, each hung to its deadline, for 58 s
    (gRPC's flow-control ping, in flight, held off every keepalive ping until its own 1 minute
    timeout). Over several servers a ping every 2 s unanswered in 3 s closes its connection; here
    0.2 s and 0.3 s, and a Generate it never answered is retried on the other."""
    monkeypatch.setattr("tandem.client.channel.REPLICA_KEEPALIVE_MS", (200, 300))
    replicas = [Replica("a"), Replica("b")]
    servers = [await serve_decoder(replica) for replica in replicas]
    proxy = FreezableProxy(servers[1].address)
    await proxy.start()
    channel = open_channel(
        [servers[0].address, proxy.address], service="tandem.v1.Decoder", own_connection=True
    )
    try:
        assert set(await _served_by(channel, 8)) == {"a", "b"}
        proxy.running.clear()  # SIGSTOP
        stub = decoder_pb2_grpc.DecoderStub(channel)
        async with asyncio.timeout(3):  # hung to the 10 s deadline before
            served = [
                (await stub.Generate(decoder_pb2.GenerateRequest(), timeout=10).read()) for _ in range(8)
            ]
        assert {reply.request_id for reply in served} == {"a"}
    finally:
        await channel.close()
        await proxy.close()
        await asyncio.gather(*(server.stop(0) for server in servers))


def test_security_files_are_read_as_regular_files_of_at_most_1_mib(tmp_path: Path) -> None:
    """As the token files are: read whole, a CA of /dev/zero grew the client without end."""
    pem = tmp_path / "ca.pem"
    pem.write_bytes(b"-----BEGIN CERTIFICATE-----\n")
    assert ChannelSecurity.from_files(ca=pem).root_certificates == b"-----BEGIN CERTIFICATE-----\n"
    with pytest.raises(ValueError, match=r"^cannot read a CA bundle: /dev/zero is not a regular file$"):
        ChannelSecurity.from_files(ca=Path("/dev/zero"))
    large = tmp_path / "chain.pem"
    large.write_bytes(b"x" * (1024 * 1024 + 1))
    with pytest.raises(
        ValueError,
        match=r"^cannot read a client certificate chain: .*chain.pem is over 1,048,576 bytes, the bound of a "
        r"client certificate chain \(1 MiB\)$",
    ):
        ChannelSecurity.from_files(cert=large, key=pem)
    with pytest.raises(ValueError, match=r"^cannot read a client private key: .*missing.pem: No such file"):
        ChannelSecurity.from_files(cert=pem, key=tmp_path / "missing.pem")


@pytest.mark.parametrize("num_servers", [1, 2], ids=["one server", "balanced, behind the first-calls gate"])
async def test_the_token_goes_with_every_call(num_servers: int) -> None:
    """The token's and the gate's interceptors are one kind (details_interceptors), chained: a
    server that requires the token serves the call, and refuses it without."""
    token = "tandem-test-token-5c1d"
    servers = []
    for name in "ab"[:num_servers]:
        service = Service("tandem.v1.Decoder", Replica(name), decoder_pb2_grpc.add_DecoderServicer_to_server)
        servers.append(await start_server(ServerOptions(auth_tokens=frozenset({token})), [service]))
        await servers[-1].set_serving()
    address = [server.address for server in servers]
    try:
        for security, expected in (
            (ChannelSecurity(token=token), None),
            (PLAINTEXT, grpc.StatusCode.UNAUTHENTICATED),
        ):
            channel = open_channel(address, service="tandem.v1.Decoder", security=security)
            try:
                call = decoder_pb2_grpc.DecoderStub(channel).Generate(
                    decoder_pb2.GenerateRequest(), timeout=10
                )
                if expected is None:
                    assert (await call.read()).request_id in ("a", "b")
                else:
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await call.read()
                    assert refused.value.code() == expected
            finally:
                await channel.close()
    finally:
        await asyncio.gather(*(server.stop(0) for server in servers))
