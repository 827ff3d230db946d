"""Interceptors that rewrite each call's details before it goes out: the bearer token's
(`auth.bearer_token`) and the first-calls gate's (`first_calls.FirstCallsGate.held`), one set for both."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc

# Rewrites a call's details before the call goes out: adds the token, holds the first calls.
DetailsRewrite = Callable[[grpc.aio.ClientCallDetails], Awaitable[grpc.aio.ClientCallDetails]]


def details_interceptors(rewrite: DetailsRewrite) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors running `rewrite` on every call's details: one per call kind, as an aio channel
    files an interceptor under its first kind only. No RPC of ours streams requests today; the
    client-streaming two are kept so that one added later is not sent without its token."""
    return [kind(rewrite) for kind in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]


class _Rewriting:
    def __init__(self, rewrite: DetailsRewrite) -> None:
        self._rewrite = rewrite


class _UnaryUnary(_Rewriting, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(
        self, continuation: Callable[..., Any], client_call_details: grpc.aio.ClientCallDetails, request: Any
    ) -> Any:
        return await continuation(await self._rewrite(client_call_details), request)


class _UnaryStream(_Rewriting, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(
        self, continuation: Callable[..., Any], client_call_details: grpc.aio.ClientCallDetails, request: Any
    ) -> Any:
        return await continuation(await self._rewrite(client_call_details), request)


class _StreamUnary(_Rewriting, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(
        self,
        continuation: Callable[..., Any],
        client_call_details: grpc.aio.ClientCallDetails,
        request_iterator: Any,
    ) -> Any:
        return await continuation(await self._rewrite(client_call_details), request_iterator)


class _StreamStream(_Rewriting, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(
        self,
        continuation: Callable[..., Any],
        client_call_details: grpc.aio.ClientCallDetails,
        request_iterator: Any,
    ) -> Any:
        return await continuation(await self._rewrite(client_call_details), request_iterator)
