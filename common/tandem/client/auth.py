"""Bearer-token authentication, both sides: the server interceptor and the client's metadata.

A caller sends `authorization: Bearer <token>`; the server accepts it when the token equals one of
its accepted tokens (a file, one per line, so tokens can be rotated by listing old and new for a
while). No header, or one that is not a bearer token, is UNAUTHENTICATED; a token that matches
none is PERMISSION_DENIED. `grpc.health.v1.Health` stays open so that load balancers and container
probes need no secret; everything else, server reflection included, needs a token.

Denied calls never reach the servicer, and their request bytes are never even parsed. Tokens are
compared with `hmac.compare_digest` against every accepted token, so the time taken does not tell
how much of a guess was right. Tokens travel in the clear unless the channel uses TLS.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

import grpc

from .flag_files import MAX_TOKEN_FILE_BYTES, read_bounded

log = logging.getLogger(__name__)

AUTHORIZATION = "authorization"  # gRPC metadata keys are lowercase.
BEARER = "bearer"
OPEN_SERVICES = ("grpc.health.v1.Health",)  # callable without a token: probes carry no secrets.


def load_tokens(path: Path) -> frozenset[str]:
    """Accepted tokens from a file: one per line; blank lines and `#` comments are skipped.

    Raises ValueError (naming the file) when it cannot be read or holds no token.
    """
    return frozenset(_read_tokens(path))


def read_token(path: Path) -> str:
    """The token a client sends: the first one in a file of the same format as the server's."""
    return _read_tokens(path)[0]


def _read_tokens(path: Path) -> list[str]:
    try:
        text = read_bounded(Path(path), MAX_TOKEN_FILE_BYTES, "a token file (64 KiB)").decode("utf-8")
    except UnicodeDecodeError:  # before ValueError, which it is: its own text does not name the file
        raise ValueError(f"cannot read the auth token file {path}: it is not UTF-8 text") from None
    except ValueError as e:
        raise ValueError(f"cannot read the auth token file: {e}") from None
    tokens = [line.strip() for line in text.splitlines()]
    tokens = [t for t in tokens if t and not t.startswith("#")]
    if not tokens:
        raise ValueError(f"the auth token file {path} holds no token")
    for number, token in enumerate(tokens, start=1):
        if not token.isascii() or any(c.isspace() for c in token):
            raise ValueError(f"the auth token file {path}: token {number} has spaces or non-ASCII characters")
    return tokens


def _is_open(method: str) -> bool:
    # method is "/package.Service/Method".
    return method.split("/")[1] in OPEN_SERVICES if method.count("/") == 2 else False


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Lets a call through only with `authorization: Bearer <accepted token>` (health is open)."""

    def __init__(self, tokens: Iterable[str]) -> None:
        self._tokens = [t.encode() for t in tokens]
        if not self._tokens:
            raise ValueError("AuthInterceptor needs at least one accepted token")

    def _denial(self, metadata: Iterable[tuple[str, Any]] | None) -> tuple[grpc.StatusCode, str] | None:
        values = [v for k, v in metadata or () if k == AUTHORIZATION]
        if not values:
            return grpc.StatusCode.UNAUTHENTICATED, "missing `authorization: Bearer <token>` metadata"
        value = values[0] if isinstance(values[0], str) else values[0].decode(errors="replace")
        scheme, _, token = value.strip().partition(" ")
        if scheme.lower() != BEARER or not token.strip():
            return grpc.StatusCode.UNAUTHENTICATED, "the authorization metadata is not `Bearer <token>`"
        presented = token.strip().encode()
        is_accepted = False
        for accepted in self._tokens:  # every one, so the time does not depend on which matched
            is_accepted |= hmac.compare_digest(presented, accepted)
        if not is_accepted:
            return grpc.StatusCode.PERMISSION_DENIED, "the bearer token is not accepted"
        return None

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method
        denial = None if _is_open(method) else self._denial(handler_call_details.invocation_metadata)
        handler = await continuation(handler_call_details)
        if denial is None or handler is None:
            return handler
        return _deny_handler(handler, method, *denial)


def _deny_handler(
    handler: grpc.RpcMethodHandler, method: str, code: grpc.StatusCode, details: str
) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that ends the call with `code`, reading no message.

    No deserializer: the request stays raw bytes, so a denied caller's input is never parsed.
    """

    async def deny(_request: Any, context: grpc.aio.ServicerContext) -> None:
        log.info("denied %s from %s: %s", method, context.peer(), code.name)
        await context.abort(code, details)

    async def deny_stream(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> None:
        # Take the first message before ending the call: a status that overtakes a client still
        # sending its first message reaches an aio client as INTERNAL instead of this code.
        await anext(aiter(requests), None)
        await deny(None, context)

    serializer = handler.response_serializer
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(deny, response_serializer=serializer)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(deny, response_serializer=serializer)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(deny_stream, response_serializer=serializer)
    return grpc.stream_stream_rpc_method_handler(deny_stream, response_serializer=serializer)


def bearer_token(
    token: str,
) -> Callable[[grpc.aio.ClientCallDetails], Awaitable[grpc.aio.ClientCallDetails]]:
    """Client side: a call's details with `authorization: Bearer <token>` added to its metadata (the
    channel runs it on every call, `call_details.details_interceptors`)."""
    metadatum = (AUTHORIZATION, f"Bearer {token}")

    async def with_token(details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), metadatum)
        return details._replace(metadata=metadata)

    return with_token
