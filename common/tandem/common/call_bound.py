"""A server's bound on the calls it runs at once, answered with a status that names it.

grpc.aio bounds a server's calls itself (`maximum_concurrent_rpcs`), and answers one past its bound
RESOURCE_EXHAUSTED "Concurrent RPC limit exceeded!", which names no number, so a caller (or its
operator) cannot tell which bound it met, and no RetryInfo. `CallBound` counts the calls as grpc.aio
does and answers first, naming the bound, with the details a program reads (an ErrorInfo CALL_LIMIT in
the server's domain, the bound as `maxCalls`, and a RetryInfo: `tandem.client.error_reasons`);
grpc.aio's own bound stays above it (`grpc_bound`), the backstop for a burst of calls that gRPC has
counted but whose handling has not reached the first interceptor yet.

NOTE: how the count matches grpc.aio's. grpc.aio runs each call in two tasks: an outer one
(`_schedule_rpc_coro`, which listens for the client's cancel), counted by its own bound from just
before it is made until it is done, and an inner one the outer makes (`_handle_exceptions`), where
every interceptor and then the handler run. `CallBound` is the first interceptor: it counts the call
when the inner task reaches it and lets go when that task is done (a done callback, as grpc.aio's
own count), so a call whose request never comes, one cancelled before its handler ran, or one that
fails keeps and then gives back its place as in grpc.aio's count. The outer task awaits the inner
one, so the two end in the same pass of the loop, the inner a callback first: a call that completes, one its
client cancels, one whose handler ignores the cancel for a second, one past its deadline, one a
server's stop ends, a stream whose client reads nothing, all measured so. Only a cancel of the outer
task itself ends it first (nothing in grpc.aio cancels it; asyncio.run's teardown does, cancelling
the inner as well), and ours then holds the place until the handler ends: stricter, never looser.
Ours counts from later than grpc.aio's, the calls whose tasks are made and not yet run, hence
`grpc_bound`'s margin. No method's behaviour is wrapped: nothing is added per message. A call past
the bound is answered by a handler that reads nothing and ends it at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from tandem.client import error_reasons as reasons
from tandem.client.errors import ResourceExhausted
from tandem.client.status import end_with

# The wait a call refused at the bound is told: nothing says when a running call ends (a stream may run
# for minutes, a health check for a millisecond), and a second is what its callers waited before it
# said one (the gateway's Retry-After, the decoder passing an encoder's refusal on), as they wait for
# the engine's own refusals by default.
RETRY_AFTER_S = 1.0


def grpc_bound(max_calls: int) -> int:
    """grpc.aio's bound for a server whose CallBound holds `max_calls`: a little above, so that ours
    answers first. grpc.aio counts a call from when it makes its task, ours once the inner task runs: the
    difference is the calls whose tasks the loop has made and not yet run, a burst's worth."""
    return max_calls + max(64, max_calls // 16)


class CallBound(grpc.aio.ServerInterceptor):
    """At most `max_calls` calls at once, streams and health checks included; one past them is
    RESOURCE_EXHAUSTED naming the bound, ErrorInfo CALL_LIMIT of `domain` (the server's:
    `error_reasons.domain_of`) and a RetryInfo of RETRY_AFTER_S."""

    def __init__(self, max_calls: int, domain: str) -> None:
        self.max_calls = max_calls
        self.num_calls = 0  # calls running now, counted as grpc.aio counts them (the NOTE)
        self._refuse = grpc.stream_stream_rpc_method_handler(self._refused)
        self._info = reasons.info_of(domain, reasons.CALL_LIMIT, {reasons.MAX_CALLS: max_calls})

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if self.num_calls >= self.max_calls:
            return self._refuse
        task = asyncio.current_task()
        assert task is not None, "grpc.aio runs every call in a task"  # the inner one (the NOTE)
        self.num_calls += 1
        task.add_done_callback(self._release)
        return await continuation(handler_call_details)

    def _release(self, _: asyncio.Task[Any]) -> None:
        self.num_calls -= 1

    async def _refused(self, requests: Any, context: grpc.aio.ServicerContext) -> None:
        message = (
            f"this server runs at most {self.max_calls:,} calls at once (streams and health checks "
            "included); retry later"
        )
        end_with(context, ResourceExhausted(message, RETRY_AFTER_S, info=self._info))
