"""Each HTTP caller reaches the decoder over a connection of its own, so the decoder tells them apart.

NOTE: why a connection per caller. The decoder shares its batch between callers and bounds each
one's open streams (`tandem.decoder.api.caller`, `stream_limit.py`); without tokens a caller is
a connection. Over one shared channel every HTTP caller was one caller to it: 32 streams held open
by one address took the connection's whole bound, and a caller from another address got 429 at
once. A caller can only be told apart where the decoder can trust the difference: a header naming
the caller would let any gRPC client name itself anew on every call, while a connection is a fact
the decoder sees itself. So each caller (its checked bearer token, else its address: `caller_of`)
gets its own channel, with a local subchannel pool so that gRPC does not share one connection
between equal channels. With tokens on, the gateway passes each caller's token on as well, and the
decoder's caller is that token.

Channels live while their caller has a call open; `max_idle` idle ones are kept for reuse (least
recently used first out), the rest closed. Open ones are bounded by the gateway's connections
(each open call holds an HTTP connection), so the decoder sees at most `--max-connections` +
`max_idle` connections from a gateway.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import grpc

from tandem.client.channel import open_channel
from tandem.client.pb.tandem.v1 import decoder_pb2_grpc
from tandem.gateway.config import GatewayConfig


def caller_of(authorization: str, peer: str | None, tokens_checked: bool) -> str:
    """Who is calling: a digest of its (checked) bearer token, else the peer's address. An unchecked
    token says nothing: a caller could send a new one with each request."""
    scheme, _, token = authorization.partition(" ")
    if tokens_checked and scheme.lower() == "bearer" and token:
        return "token:" + hashlib.blake2b(token.encode(), digest_size=16).hexdigest()
    return f"peer:{peer}"


@dataclass
class _Channel:
    channel: grpc.aio.Channel
    stub: decoder_pb2_grpc.DecoderStub
    num_calls: int = 0  # calls open on it


class CallerChannels:
    """A channel to the decoder per caller; event-loop thread only."""

    def __init__(self, open_channel: Callable[[], grpc.aio.Channel], max_idle: int) -> None:
        self._open_channel = open_channel  # a new channel on a connection of its own
        self.max_idle = max_idle
        self._channels: OrderedDict[str, _Channel] = OrderedDict()  # least recently used first
        self._closing: set[asyncio.Task[None]] = set()

    @property
    def num_channels(self) -> int:
        return len(self._channels)

    @contextlib.asynccontextmanager
    async def stub(self, caller: str) -> AsyncIterator[decoder_pb2_grpc.DecoderStub]:
        """The decoder stub of `caller`'s own channel, held for the body."""
        held = self._channels.get(caller)
        if held is None:
            channel = self._open_channel()
            held = self._channels[caller] = _Channel(channel, decoder_pb2_grpc.DecoderStub(channel))
        self._channels.move_to_end(caller)
        held.num_calls += 1
        try:
            yield held.stub
        finally:
            held.num_calls -= 1
            self._close_idle_beyond_bound()

    def _close_idle_beyond_bound(self) -> None:
        idle = [caller for caller, held in self._channels.items() if held.num_calls == 0]
        for caller in idle[: max(0, len(idle) - self.max_idle)]:
            task = asyncio.ensure_future(self._channels.pop(caller).channel.close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        channels = [held.channel for held in self._channels.values()]
        self._channels.clear()
        await asyncio.gather(*(channel.close() for channel in channels), *self._closing)


def decoder_channels(
    config: GatewayConfig, interceptors: Sequence[grpc.aio.ClientInterceptor] = ()
) -> CallerChannels:
    """Each caller's channel to `config`'s decoder: its TLS and token, and `interceptors` (tracing)."""
    return CallerChannels(
        lambda: open_channel(
            config.decoder_address,
            config.max_message_bytes,
            config.upstream,
            interceptors,
            "tandem.v1.Decoder",
            own_connection=True,
        ),
        config.max_idle_channels,
    )
