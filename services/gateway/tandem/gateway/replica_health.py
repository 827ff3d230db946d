"""One replica's health, by Watch and Check: whether it serves, told to `Replicas` each time it is said,
over the replica's own channel (`replica_channel.py`). What a late Check counts for is `Replicas`' to
say (`Replicas._late_check`): it depends on the other replicas."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

# A Watch that ended, was refused or said the replica does not serve is asked again after this,
# doubling up to MAX_RETRY_S while the replica does not serve. A refused one leaves the replica's
# health to Check (unbounded). One that says NOT_SERVING is ended at once: a draining server's stop
# waits for every stream it holds, a Watch too, so a gateway that kept watching held every decoder's
# drain for its whole --grace-s (gRPC's own health checking lets go as the drain's GOAWAY comes).
MIN_RETRY_S, MAX_RETRY_S = 0.2, 5.0
# A Check is answered at once by a live server; one that has not answered in this long (a process
# stopped or its loop held) is counted not serving until a later Watch or Check says it serves, where
# another replica serves (see `Replicas._late_check`).
CHECK_TIMEOUT_S = 2.0
# While a Watch is open the replica is also asked by Check this often: a process stopped (SIGSTOP, a
# frozen VM) leaves its Watch open and says nothing, and its connection is found dead only by keepalive
# (30 s + 10 s then, so it kept half of all new calls for 60-80 s; 2 s + 3 s now, `replica_channel.py`):
# where another replica serves, a late Check takes it out sooner.
CHECK_INTERVAL_S = 2.0

SERVING = health_pb2.HealthCheckResponse.SERVING


async def watch_health(
    channel: grpc.aio.Channel,
    service: str,
    on_status: Callable[[bool], None],
    late: Callable[[], bool | None],
    spawn: Callable[[Coroutine[Any, Any, None]], asyncio.Task[None]],
) -> None:
    """Tells `on_status` whether the replica behind `channel` serves `service`, as a Watch or Check says,
    until cancelled. `late`: what a Check unanswered in CHECK_TIMEOUT_S, its Watch open, counts for;
    `spawn`: runs the Checks made while a Watch is open as a task whose failure is logged."""
    stub = health_pb2_grpc.HealthStub(channel)
    request = health_pb2.HealthCheckRequest(service=service)
    retry_s = MIN_RETRY_S
    while True:
        watch = stub.Watch(request)
        checking = spawn(_check_while_watched(stub, request, on_status, late))
        try:
            async for reply in watch:
                on_status(reply.status == SERVING)
                if reply.status != SERVING:
                    break  # a drain waits for it: see MIN_RETRY_S
                retry_s = MIN_RETRY_S
        except grpc.aio.AioRpcError:
            checking.cancel()
            on_status(await check(stub, request) is True)
        finally:
            watch.cancel()
            checking.cancel()
        await asyncio.sleep(retry_s)
        retry_s = min(2 * retry_s, MAX_RETRY_S)


async def _check_while_watched(
    stub: health_pb2_grpc.HealthStub,
    request: health_pb2.HealthCheckRequest,
    on_status: Callable[[bool], None],
    late: Callable[[], bool | None],
) -> None:
    """Checks the replica every CHECK_INTERVAL_S while its Watch is open: one that stops answering
    is counted not serving within CHECK_INTERVAL_S + CHECK_TIMEOUT_S, and serving again as it
    answers (its Watch, open all along, says nothing new)."""
    while True:
        await asyncio.sleep(CHECK_INTERVAL_S)
        is_serving = await check(stub, request, late=late)
        if is_serving is not None:
            on_status(is_serving)


async def check(
    stub: health_pb2_grpc.HealthStub,
    request: health_pb2.HealthCheckRequest,
    late: Callable[[], bool | None] = lambda: False,
) -> bool | None:
    """Whether the replica serves, by Check: a Watch refused (its address's share taken, by
    others behind the gateway's address) or ended still leaves the replica's health known.
    None: not known, the server at its bound of calls; unanswered in CHECK_TIMEOUT_S, what `late()`
    says as the time runs out (`Replicas._late_check`)."""
    try:
        reply = await stub.Check(request, timeout=CHECK_TIMEOUT_S)
    except grpc.aio.AioRpcError as error:
        if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return late()
        # A server at its bound of calls (max_concurrent_rpcs) answers RESOURCE_EXHAUSTED: it is
        # alive and busy, not stopped; taking it out for that would flap a loaded replica.
        return None if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED else False
    return reply.status == SERVING
