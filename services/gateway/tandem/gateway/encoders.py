"""The gateway's encoder (/v1/embeddings, and a chat's pictures where the decoder fetches none): over
several replicas, one channel over those that serve the model most of them serve.

NOTE: why encoder replicas are checked as decoder replicas are. `--encoder-address a,b` was one gRPC
channel balanced over both, each call to either: an encoder of another checkpoint, or another embedder
of the same one (a token table lookup beside a projector), answered half the embeddings, vectors of two
models under one name that nothing compared, and a chat's pictures embedded here went to the decoder as
rows of the wrong model. Each replica is watched and asked its model as it turns SERVING by the
decoder replicas' `Replicas` (`replicas.py`: the same majority, ties, restarts, logging at ERROR), its
model the checkpoint its rows are for, its token table sample and its embedder (`replica_model.py`),
and the calls go over a channel opened over `Replicas.targets`: one of another model gets none. (A
decoder started with --encoder checks its encoders itself, each reply against its own checkpoint:
`tandem.decoder.api.encoder_parts`.) Not told apart: two projectors for one decoder checkpoint from two
encoder checkpoints, which report the same model, sample and embedder.

The stub stays the same (`EncoderInfo` holds it); each call goes over the channel open at the time.
When the targets change, a new channel is opened over them and the old one is closed once its calls
end (at most RETIRE_GRACE_S: the calls are embeddings, well under a second each). While no replica
serves the model (`Replicas.targets` empty), a call raises Unavailable (the gateway's 503) at once.

One address is one channel with the replicas' keepalive (`OneEncoder`); a `dns://server/name` naming a
DNS server the gateway's resolver does not ask is one channel as before, balanced by gRPC's own health
checking.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import grpc

from tandem.client.channel import open_channel
from tandem.client.client import EncoderClient
from tandem.client.errors import Unavailable
from tandem.client.pb.tandem.v1 import encoder_pb2, encoder_pb2_grpc
from tandem.gateway.config import GatewayConfig
from tandem.gateway.encoder_info import Answering
from tandem.gateway.replica_addresses import name_of, names_one_server
from tandem.gateway.replica_channel import open_replica_channel
from tandem.gateway.replica_model import ReplicaModel
from tandem.gateway.replicas import Replicas

if TYPE_CHECKING:  # OpenTelemetry is optional
    from tandem.client.telemetry import Telemetry

ENCODER_SERVICE = "tandem.v1.Encoder"
MODEL_TIMEOUT_S = 10.0  # a replica's GetModelInfo, as the decoders' (`callers.py`)
RETIRE_GRACE_S = 60.0  # a channel over replicas no longer the targets is closed once its calls end, or this


class GatewayEncoder(Protocol):
    """What the gateway holds of its encoder, whichever `gateway_encoder` built: a stub whose calls go
    to the encoder (one channel, or the replicas serving the model), closed once at the gateway's end."""

    stub: encoder_pb2_grpc.EncoderStub

    async def close(self) -> None: ...


class _Routed:
    """Stands in for a channel in a stub: each call goes over the channel `channel_now` gives, or
    raises Unavailable saying `none_serving()` where it gives none (no replica serves the model)."""

    def __init__(
        self, channel_now: Callable[[], grpc.aio.Channel | None], none_serving: Callable[[], str]
    ) -> None:
        self._channel_now = channel_now
        self._none_serving = none_serving

    def unary_unary(
        self,
        method: str,
        request_serializer: Callable[[Any], bytes] | None = None,
        response_deserializer: Callable[[bytes], Any] | None = None,
        _registered_method: bool | None = False,
    ) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            channel = self._channel_now()
            if channel is None:
                raise Unavailable(self._none_serving())
            return channel.unary_unary(method, request_serializer, response_deserializer, _registered_method)(
                *args, **kwargs
            )

        return call


class EncoderReplicas:
    """The encoder's replicas (`replicas`, started here) behind one stub; event-loop thread only."""

    def __init__(
        self, replicas: Replicas, open_channel: Callable[[tuple[str, ...]], grpc.aio.Channel]
    ) -> None:
        self.replicas = replicas
        self._open_channel = open_channel  # a channel balanced over these replicas, watching none
        replicas.start()  # a list's replicas are found at once: the first channel is over them
        self._channel: grpc.aio.Channel | None = open_channel(replicas.targets)
        replicas.on_change = self._retire
        self._closing: set[asyncio.Task[None]] = set()
        self.stub = encoder_pb2_grpc.EncoderStub(_Routed(lambda: self._channel, replicas.none_serving))

    def _retire(self) -> None:
        targets = self.replicas.targets
        retired, self._channel = self._channel, self._open_channel(targets) if targets else None
        if retired is not None:
            task = asyncio.ensure_future(retired.close(grace=RETIRE_GRACE_S))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        await self.replicas.close()
        await asyncio.gather(*([self._channel.close()] if self._channel is not None else []), *self._closing)


class OneEncoder:
    """One encoder address, not watched: one channel to it with the replicas' keepalive (a ping every
    2 s, unanswered in 3 s), as one decoder's callers have. `EncoderClient`'s channel had one server's
    (30 s + 10 s): with the encoder stopped (SIGSTOP) the embeddings sent meanwhile waited 55-60 s."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self._channel = channel
        self.stub = encoder_pb2_grpc.EncoderStub(channel)

    async def close(self) -> None:
        await self._channel.close()


def answering(encoder: GatewayEncoder) -> Callable[[], Answering]:
    """What `EncoderInfo` asks again on a change of: the model the replicas serve and those called (one
    client: nothing, asked once)."""
    if isinstance(encoder, EncoderReplicas):
        replicas = encoder.replicas
        return lambda: Answering(replicas.model, replicas.targets)
    return Answering


async def encoder_model(
    channel: grpc.aio.Channel, metadata: tuple[tuple[str, str], ...] | None = None
) -> ReplicaModel:
    """The model the encoder at the other end of `channel` embeds for (`Replicas` compares them)."""
    stub = encoder_pb2_grpc.EncoderStub(channel)
    request = encoder_pb2.EncoderGetModelInfoRequest()
    info = await stub.GetModelInfo(request, metadata=metadata, timeout=MODEL_TIMEOUT_S)
    return ReplicaModel.from_encoder_info(info)


def gateway_encoder(
    config: GatewayConfig,
    telemetry: Telemetry | None = None,
    model_check_metadata: tuple[tuple[str, str], ...] | None = None,
) -> GatewayEncoder:
    """`config`'s encoder: its replicas watched and checked where it names several, one channel with the
    replicas' keepalive where it names one address, else (a DNS server of its own) one client.
    `model_check_metadata`: the token each replica's model is asked with (`callers.model_check_metadata`).
    Call from the event loop."""
    address, security = config.encoder_address, config.upstream
    try:
        authority = name_of(address)  # replicas found from a name still go by it (TLS)
    except ValueError:  # dns://server/name: a DNS server the gateway's resolver does not ask
        return EncoderClient(address, config.max_message_bytes, telemetry, security)
    interceptors = telemetry.client_interceptors() if telemetry is not None else []
    if names_one_server(address):
        return OneEncoder(open_replica_channel(address, config.max_message_bytes, security, interceptors))

    def open_replica(replica: str) -> grpc.aio.Channel:
        return open_replica_channel(replica, config.max_message_bytes, security, authority=authority)

    def open_balanced(targets: tuple[str, ...]) -> grpc.aio.Channel:
        if len(targets) == 1 and names_one_server(targets[0]):  # one replica left: its keepalive too
            return open_replica_channel(
                targets[0],
                config.max_message_bytes,
                security,
                interceptors,
                authority=None if targets == (address,) else authority,
            )
        return open_channel(
            ",".join(targets),
            config.max_message_bytes,
            security,
            interceptors,
            ENCODER_SERVICE,
            is_health_checked=False,  # `Replicas` watches
            authority=None if targets == (address,) else authority,
        )

    model_of = functools.partial(encoder_model, metadata=model_check_metadata)
    replicas = Replicas(address, open_replica, ENCODER_SERVICE, model_of=model_of, kind="encoder")
    return EncoderReplicas(replicas, open_balanced)
