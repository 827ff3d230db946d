"""What both clients share: the channel (`channel.py`) with the telemetry's interceptors, the metrics
and spans a call records, and the server's health: a Check, and a wait until it serves."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from .addresses import server_of
from .channel import open_channel
from .client_telemetry import telemetry_from_environ
from .security import ChannelSecurity

if TYPE_CHECKING:  # OpenTelemetry is optional: a caller that passes telemetry has it installed
    from .telemetry import ClientMetrics, Telemetry
    from .telemetry.client_spans import ClientSpans


# How a server answers a Watch past its bounds (common/health.py): UNIMPLEMENTED while it serves (so
# that gRPC's own health checking assumes it healthy), RESOURCE_EXHAUSTED while it does not.
_WATCH_REFUSED = (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.RESOURCE_EXHAUSTED)


class ServiceClient:
    def __init__(
        self,
        address: str | Sequence[str],
        max_message_bytes: int,
        telemetry: Telemetry | None,
        security: ChannelSecurity,
        service: str,
        is_health_checked: bool,
    ) -> None:
        telemetry = telemetry if telemetry is not None else telemetry_from_environ()
        interceptors = telemetry.client_interceptors() if telemetry is not None else []
        self.channel = open_channel(
            address, max_message_bytes, security, interceptors, service, is_health_checked=is_health_checked
        )
        self._health = health_pb2_grpc.HealthStub(self.channel)
        self._metrics: ClientMetrics | None = None
        self._spans: ClientSpans | None = None
        if telemetry is not None and telemetry.is_metrics:
            from .telemetry.metrics import ClientMetrics  # here: OpenTelemetry is optional

            self._metrics = ClientMetrics(telemetry.meter)
        if telemetry is not None and telemetry.is_tracing:
            from .telemetry.client_spans import ClientSpans

            self._spans = ClientSpans(telemetry.tracer, server_of(address))

    async def health(self, service: str = "", timeout: float = 5.0) -> int:
        """The server's health status for `service` ("" = the whole server)."""
        reply = await self._health.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        return reply.status

    async def wait_serving(self, timeout: float = 120.0) -> None:
        """Block until health says SERVING (the model is loaded and warmed up).

        A balanced channel picks only SERVING servers, so until one is, the check itself is
        UNAVAILABLE: asked again until `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("the server never became SERVING")
            try:
                stream = self._health.Watch(
                    health_pb2.HealthCheckRequest(service=""), timeout=remaining, wait_for_ready=True
                )
                async for reply in stream:
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        stream.cancel()
                        return
            except grpc.aio.AioRpcError as error:
                if error.code() in _WATCH_REFUSED:
                    if await self._check_serving(deadline - time.monotonic()):
                        return
                elif error.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise
            await asyncio.sleep(min(0.2, max(0.0, deadline - time.monotonic())))

    async def _check_serving(self, remaining: float) -> bool:
        """Whether a Check says SERVING, for a server that refused this client's Watch (its places
        held from this address: health.py). Check is never refused; a server without health at all
        answers it UNIMPLEMENTED too, raised."""
        try:
            reply = await self._health.Check(
                health_pb2.HealthCheckRequest(service=""), timeout=max(remaining, 0.001), wait_for_ready=True
            )
        except grpc.aio.AioRpcError as error:
            if error.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
