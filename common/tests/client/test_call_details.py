"""The details rewrites (token, first-calls gate) run on every call, whatever its kind."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from common.tests.client.replica import Replica
from tandem.client.channel import open_channel
from tandem.client.pb.tandem.v1 import decoder_pb2, decoder_pb2_grpc
from tandem.client.security import PLAINTEXT, ChannelSecurity
from tandem.common.server import ServerOptions, Service, start_server


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
