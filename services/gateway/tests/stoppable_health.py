"""A replica's health service that a test stops and starts: what the gateway's watch of a replica
(`replica_health.py`, `Replicas`) sees of a process stopped, or of one at its bound of calls."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING


class StoppableHealth(health_pb2_grpc.HealthServicer):
    """A replica's health as a process stopped (SIGSTOP, a frozen VM) shows it: its Watch stays open
    and says nothing more, and its Check is never answered; or, `is_busy`, a live one at its bound
    of calls, whose Check is refused RESOURCE_EXHAUSTED."""

    def __init__(self) -> None:
        self.running = asyncio.Event()
        self.running.set()
        self.is_busy = False

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        await self.running.wait()
        if self.is_busy:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "at its bound of calls")
        return health_pb2.HealthCheckResponse(status=SERVING)

    async def Watch(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        yield health_pb2.HealthCheckResponse(status=SERVING)
        await asyncio.Event().wait()  # open for good, stopped or not


@contextlib.asynccontextmanager
async def serve_stoppable() -> AsyncIterator[tuple[StoppableHealth, str]]:
    """A `StoppableHealth` served on 127.0.0.1, and its address; running again before it stops (a
    Check held on it would hold the stop)."""
    health = StoppableHealth()
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield health, f"127.0.0.1:{port}"
    finally:
        health.running.set()
        await server.stop(0)
