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
`max_idle` connections from a gateway, and for a moment one more per replica as a caller's channel
over several opens (its first calls wait for its connections to every replica: the warm-up's health
Check, on a connection of its own, `tandem.client.first_calls`).

Decoder replicas (one address is one replica): a caller's channel balances over the replicas that
serve when it opens (`replicas.py`, which watches each replica's health once for every caller), and
watches none itself, so a gateway holds a few health Watch streams on a replica however many callers
it has. When that set changes, a caller's channel over an older one takes no new calls: an idle one
is closed, a busy one once its calls end, and the caller's next call opens a channel over the new set.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import grpc

from tandem.client.channel import open_channel
from tandem.client.errors import Unavailable
from tandem.client.pb.tandem.v1 import decoder_pb2, decoder_pb2_grpc
from tandem.gateway.config import GatewayConfig
from tandem.gateway.replica_addresses import name_of, names_one_server
from tandem.gateway.replica_channel import open_replica_channel
from tandem.gateway.replica_model import ReplicaModel
from tandem.gateway.replicas import Replicas

MODEL_TIMEOUT_S = 10.0  # a replica's model asked as it turns SERVING; unanswered, it is not checked
DECODER_SERVICE = "tandem.v1.Decoder"  # its health status is what the replicas are watched for
# The gateway's own calls (model info) as a caller: no `caller_of` key has this form.
GATEWAY_CALLER = "gateway"


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
    targets: tuple[str, ...]  # the replicas it balances over (`Replicas.targets` when it opened)
    num_calls: int = 0  # calls open on it
    is_retired: bool = False  # takes no new calls: closed once its last call ends


class CallerChannels:
    """A channel to the decoder per caller; event-loop thread only."""

    def __init__(
        self,
        open_channel: Callable[[tuple[str, ...]], grpc.aio.Channel],
        max_idle: int,
        replicas: Replicas,
    ) -> None:
        self._open_channel = open_channel  # a new channel over these targets, on connections of its own
        self.max_idle = max_idle
        self.replicas = replicas  # the decoder's replicas (one address is one), watched for every caller
        self._channels: OrderedDict[str, _Channel] = OrderedDict()  # least recently used first
        self._closing: set[asyncio.Task[None]] = set()
        replicas.on_change = self.retire_stale
        replicas.start()

    @property
    def num_channels(self) -> int:
        return len(self._channels)

    @property
    def targets(self) -> tuple[str, ...]:
        return self.replicas.targets

    @contextlib.asynccontextmanager
    async def stub(self, caller: str) -> AsyncIterator[decoder_pb2_grpc.DecoderStub]:
        """The decoder stub of `caller`'s own channel, held for the body. Raises Unavailable (a 503)
        where no replica serves the gateway's model (`Replicas.targets`)."""
        targets = self.targets
        if not targets:
            raise Unavailable(self.replicas.none_serving())
        held = self._channels.get(caller)
        if held is not None and held.targets != targets:
            self._retire(caller)
            held = None
        if held is None:
            channel = self._open_channel(targets)
            held = _Channel(channel, decoder_pb2_grpc.DecoderStub(channel), targets)
            self._channels[caller] = held
        self._channels.move_to_end(caller)
        held.num_calls += 1
        try:
            yield held.stub
        finally:
            held.num_calls -= 1
            if held.is_retired and not held.num_calls:
                self._close(held)
            self._close_idle_beyond_bound()

    def retire_stale(self) -> None:
        """Channels over other replicas than `targets` now take no new calls; idle ones are closed."""
        for caller in [c for c, held in self._channels.items() if held.targets != self.targets]:
            self._retire(caller)

    def _retire(self, caller: str) -> None:
        held = self._channels.pop(caller)
        held.is_retired = True
        if not held.num_calls:
            self._close(held)

    def _close_idle_beyond_bound(self) -> None:
        idle = [caller for caller, held in self._channels.items() if held.num_calls == 0]
        for caller in idle[: max(0, len(idle) - self.max_idle)]:
            self._close(self._channels.pop(caller))

    def _close(self, held: _Channel) -> None:
        task = asyncio.ensure_future(held.channel.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        channels = [held.channel for held in self._channels.values()]
        self._channels.clear()
        await self.replicas.close()
        await asyncio.gather(*(channel.close() for channel in channels), *self._closing)


def decoder_channels(
    config: GatewayConfig, interceptors: Sequence[grpc.aio.ClientInterceptor] = ()
) -> CallerChannels:
    """Each caller's channel to `config`'s decoder: its TLS and token, and `interceptors` (tracing).
    Its replicas (one, or several) are watched by a `Replicas` started here: call from the event loop."""
    address = config.decoder_address
    authority = name_of(address)  # replicas found from a name still go by it (TLS)

    def open_replica(replica: str) -> grpc.aio.Channel:
        return open_replica_channel(replica, config.max_message_bytes, config.upstream, authority=authority)

    def open_caller_channel(targets: tuple[str, ...]) -> grpc.aio.Channel:
        if len(targets) == 1 and names_one_server(targets[0]):  # one replica: its keepalive too
            return open_replica_channel(
                targets[0],
                config.max_message_bytes,
                config.upstream,
                interceptors,
                own_connection=True,
                authority=None if targets == (address,) else authority,
            )
        return open_channel(
            list(targets),  # never empty: `CallerChannels.stub` raised Unavailable first
            config.max_message_bytes,
            config.upstream,
            interceptors,
            DECODER_SERVICE,
            own_connection=True,
            is_health_checked=False,  # `Replicas` watches for every caller
            authority=None if targets == (address,) else authority,
        )

    # One address is watched too, as one replica: /health answers from its watch, and a decoder that
    # does not serve is the gateway's 503 at once (app.py). Asked live, /health waited out a 2 s Check
    # on a decoder that accepted connections and said nothing, and /v1/models its 10 s timeout.
    model_of = functools.partial(decoder_model, metadata=model_check_metadata(config))
    replicas = Replicas(address, open_replica, DECODER_SERVICE, model_of=model_of)
    return CallerChannels(open_caller_channel, config.max_idle_channels, replicas)


def model_check_metadata(config: GatewayConfig) -> tuple[tuple[str, str], ...] | None:
    """The token each replica's model is asked with (`decoder_model`), where the channel has none.

    A gateway with a token of its own towards the services (--upstream-auth-token-file) sends it on
    every channel. One passing its callers' tokens on has none of its own, and the replicas refused
    its asks: no replica's model was checked. It checks the callers' tokens against the services'
    token file (--auth-token-file), so it asks with one of those, the same for every ask (the least):
    a caller's token would do too, but none may come before the replicas serve. Where the decoders
    refuse it (a token file of their own without it: UNAUTHENTICATED or PERMISSION_DENIED), each
    replica's model is not known: each one is not checked, logged at ERROR, gets calls and is never
    left out for its model, one that said a model before the refusals began too (its model forgotten:
    `replicas.py`, the NOTE on asking again)."""
    if config.auth_tokens is None or config.upstream.token is not None or not config.auth_tokens:
        return None
    return (("authorization", f"Bearer {min(config.auth_tokens)}"),)


async def decoder_model(
    channel: grpc.aio.Channel, metadata: tuple[tuple[str, str], ...] | None = None
) -> ReplicaModel:
    """The model the decoder at the other end of `channel` serves (`Replicas` compares them)."""
    stub = decoder_pb2_grpc.DecoderStub(channel)
    request = decoder_pb2.DecoderGetModelInfoRequest()
    info = await stub.GetModelInfo(request, metadata=metadata, timeout=MODEL_TIMEOUT_S)
    return ReplicaModel.from_info(info)
