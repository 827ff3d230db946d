"""What every request passes around its handler: its framing (a Transfer-Encoding other than chunked is
refused), its server span, its token (401), and its errors answered in OpenAI's shape, each refusal
leaving no body to be read past a bound; and the expect handlers, which aiohttp runs before any
middleware, refusing a request head that announces a body in the same order before the body is sent.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from aiohttp import HttpVersion11, hdrs, web

from tandem.client.errors import InvalidArgument, Unavailable
from tandem.client.memory import give_back
from tandem.client.semconv import TANDEM_CALLER_DISCONNECTED
from tandem.gateway.body_codings import coding_refusal, framing_refusal
from tandem.gateway.body_intake import BODY_NAMES, LARGE_BODY, WAS_LARGE, has_body_left, too_large_body
from tandem.gateway.config import GatewayConfig
from tandem.gateway.connections import ConnectionGuard, is_left_by_caller
from tandem.gateway.errors import BodyNames, HttpError, Refused, from_grpc, from_invalid
from tandem.gateway.http_span import (
    cut_attributes,
    left_attributes,
    request_attributes,
    response_attributes,
    route_of,
    span_name,
)
from tandem.gateway.log_text import printable
from tandem.gateway.refusals import answer_and_close, drop_rest, error_response

log = logging.getLogger("tandem.gateway")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# The W3C headers a caller's trace context comes in (tandem.client.telemetry.propagation reads them).
_PROPAGATED_HEADERS = ("traceparent", "tracestate", "baggage")
# The server span's status of a request the gateway ended before its answer ended, its caller still there.
GATEWAY_CUT = "the gateway ended the request: its shutdown's --grace-s passed, or its --write-timeout-s"


class Middlewares:
    """The gateway's middlewares (`Gateway.app` orders them: framing, trace, errors, authenticate) and
    its expect handlers, over one config, connection guard and tracer."""

    def __init__(
        self,
        config: GatewayConfig,
        unauthenticated_paths: tuple[str, ...],
        guard: ConnectionGuard | None = None,
        tracer: Any = None,
    ) -> None:
        self.config = config
        self.unauthenticated_paths = unauthenticated_paths  # served without a token (the health probe)
        self.guard = guard  # told of each request head (the first one ends a connection's header timer)
        self.tracer = tracer  # an OpenTelemetry tracer when tracing is on: one span per HTTP request

    async def expect_body(self, request: web.Request) -> web.StreamResponse | None:
        """`_expect` for a route that reads the body: `100 Continue` where it is not refused."""
        return await self._expect(request, reads_body=True)

    async def expect_no_body(self, request: web.Request) -> web.StreamResponse | None:
        """`_expect` for a route that reads no body: never `100 Continue`, the answer comes without it
        (RFC 9110 10.1.1), and what was announced is not read (`framing`)."""
        return await self._expect(request, reads_body=False)

    async def _expect(self, request: web.Request, reads_body: bool) -> web.StreamResponse | None:
        """A request head with an `Expect`: refused before its body is sent where the normal path
        refuses it unread, in the same order (a Transfer-Encoding other than chunked, 401 without an
        accepted token, 417 for another expectation than 100-continue, then, where the route reads the
        body, 413 for a declared length over --max-body-bytes, then a coding the gateway does not
        decode), the answer saying `Connection: close`; else `100 Continue` where the route reads the body.
        aiohttp runs this before the middlewares, and its own handler sent `100 Continue` to every head:
        a client uploaded a whole body (5,000 bytes over a 4,096 bound) only to be answered 413."""
        if self.guard is not None:
            self.guard.head_received(request.transport)  # as the middleware would: it runs after, or never
        if request.version != HttpVersion11:  # HTTP/1.0 has no interim answers: its expectation ignored
            return None
        if (refusal := self._expect_refusal(request, reads_body)) is not None:
            # Answered by aiohttp, which then lingers (LINGERING_S), reading and dropping unparsed what
            # comes of the body before it closes (`drop_rest`): a client may send the body without
            # waiting for `100 Continue` (RFC 9110 10.1.1; Python's http.client does), and a socket
            # closed under an arriving body is reset, the answer lost (5 of 5 such 5 MB uploads read
            # ConnectionResetError instead of their 401).
            response = error_response(refusal)
            response.force_close()
            if has_body_left(request):
                drop_rest(request, response)
            return response
        if not reads_body:
            return None
        try:
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        except ConnectionResetError:  # the caller left after its head: as `errors` treats it, no traceback
            raise asyncio.CancelledError from None
        request.writer.output_size = 0  # as aiohttp's: the answer's size, for the access log, starts after
        return None

    def _expect_refusal(self, request: web.Request, reads_body: bool) -> HttpError | None:
        """What `_expect` refuses `request` with, in the normal path's order, or None."""
        if (framing := framing_refusal(request.headers, request.version)) is not None:
            return framing
        if (unauthenticated := self._unauthenticated(request)) is not None:
            return unauthenticated  # before a caller with no token is told anything of its request
        # Every line of it: a second (`Expect: 100-continue` then `Expect: foo`) went unread, `100 Continue`.
        expect = ", ".join(request.headers.getall(hdrs.EXPECT, ()))
        # The expectations it lists, each met (a client repeating 100-continue was refused 417).
        if {member.strip().lower() for member in expect.split(",")} != {"100-continue"}:
            message = f"Expect: {expect[:64]!r} is not an expectation this server meets (only 100-continue)"
            return HttpError(417, "invalid_request_error", message)
        if not reads_body:
            return None
        declared = request.content_length
        if declared is not None and declared > self.config.max_body_bytes:
            return too_large_body(self.config.max_body_bytes)
        return coding_refusal(request.headers)

    @web.middleware
    async def errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if self.guard is not None:
            self.guard.head_received(request.transport)
        try:
            return await handler(request)
        except Refused as refused:
            response = error_response(refused.error)
            if refused.close:
                await answer_and_close(request, response)
            elif refused.error.status == 413 and has_body_left(request):
                # The rest of a body over --max-body-bytes may still be coming: not worth reading (aiohttp
                # would, for its lingering time). A 413 after the whole body was read (an answer or a
                # call over its bound) keeps the connection: a client's next request reuses it.
                response.force_close()
            elif request.content.exception() is not None:  # a body that cannot be read cannot be drained
                response.force_close()
                # aiohttp's drain after the answer would read the failure again and log it as its own
                # "Unhandled exception", with a traceback.
                request.content.feed_eof()
            return response
        except InvalidArgument as error:
            return error_response(from_invalid(error))
        except Unavailable as error:
            return error_response(HttpError(503, "service_unavailable", str(error), retry_after_s=1.0))
        except grpc.aio.AioRpcError as error:
            return error_response(from_grpc(error, request.get(BODY_NAMES) or BodyNames()))
        except web.HTTPException as error:  # 404 / 405 from routing
            response = error_response(HttpError(error.status, "invalid_request_error", error.reason))
            if isinstance(error, web.HTTPMethodNotAllowed):  # RFC 9110: a 405 says what is allowed
                response.headers["Allow"] = ", ".join(sorted(error.allowed_methods))
            return response
        except ConnectionResetError:
            # A write to a connection closed before aiohttp has seen it close (the caller reset it, or it
            # took nothing for --write-timeout-s): the handler ends as aiohttp ends one whose caller left,
            # where aiohttp would log this as the server's error, with a traceback.
            raise asyncio.CancelledError from None
        except asyncio.CancelledError:
            raise  # the caller left: nothing to answer
        except Exception:  # a bug: an OpenAI-shaped 500, the traceback in our log only
            # The path as sent, escaped: decoded, a caller's `%00` or `%E2%80%AE` put a NUL or a
            # right-to-left override into the log.
            log.exception("%s %s failed", request.method, printable(request.rel_url.raw_path))
            return error_response(HttpError(500, "server_error", "the gateway failed on this request"))
        finally:
            if (held := request.get(LARGE_BODY)) is not None:
                held.release()
            if request.get(WAS_LARGE):
                give_back()  # the body's and the answer's heap back to the OS (tandem.client.memory)

    @web.middleware
    async def framing(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """A request whose Transfer-Encoding is anything but chunked alone: 400 naming it, whatever its
        path and whoever sends it, and nothing after its head read as HTTP (`framing_refusal`'s NOTE:
        its connection was kept, its body drained by a framing a proxy in front may not share).

        NOTE: why an answer that leaves a body unread past a bound closes. aiohttp drains what its
        handler left of a body (its lingering read) and keeps the connection where the body ends in that
        time, however large: GET /health or /v1/models, a 404 or a 405, with 64 MiB over a 1 MiB
        --max-body-bytes, parsed all of it and served the next request on the connection. What is left is
        drained only where its length is declared within --max-body-bytes and it was not held back for
        a `100 Continue` (which a route reading no body never sends); else it is dropped unparsed and the
        connection closed after the answer, as a 401 does (`drop_rest`)."""
        if (refusal := framing_refusal(request.headers, request.version)) is None:
            response = await handler(request)
            if has_body_left(request) and not self._is_drained(request):
                drop_rest(request, response)
            return response
        if self.guard is not None:
            self.guard.head_received(request.transport)  # as `errors` would: it does not run
        response = error_response(refusal)
        drop_rest(request, response)
        return response

    @web.middleware
    async def authenticate(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """401 for a request without an accepted token, before anything else reads it.

        NOTE: why a 401 drops what is left of the body and closes. aiohttp drains a body its answer left
        (its lingering read) and keeps the connection where the whole body came in that time: a caller
        with no token had the gateway parse a second's worth of body (LINGERING_S), over --max-body-bytes
        too (a 401 to 64 MiB sent whole parsed all of it and kept the connection for the next one). The
        rest is dropped unparsed instead (`drop_rest`): a client still sending reads the 401 rather than
        a reset, and the connection then closes. A body that came whole with its head costs nothing
        more: that connection is kept. No byte of it is decoded (body_codings' NOTE)."""
        if (refusal := self._unauthenticated(request)) is None:
            return await handler(request)
        response = error_response(refusal)
        if has_body_left(request):
            drop_rest(request, response)
        return response

    def _is_drained(self, request: web.Request) -> bool:
        """Whether what an answer left of `request`'s body is worth draining (`framing`'s NOTE)."""
        declared = request.content_length
        is_bounded = declared is not None and declared <= self.config.max_body_bytes
        return is_bounded and hdrs.EXPECT not in request.headers

    def _unauthenticated(self, request: web.Request) -> HttpError | None:
        """A 401 when tokens are checked and `request` carries no accepted bearer token."""
        tokens = self.config.auth_tokens
        if tokens is not None and request.path not in self.unauthenticated_paths:
            scheme, _, token = request.headers.get("Authorization", "").partition(" ")
            if scheme.lower() != "bearer" or token not in tokens:
                return HttpError(401, "authentication_error", "missing or unknown bearer token")
        return None

    @web.middleware
    async def trace(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """The request's server span (`http_span.py`: its name and attributes), outside `errors` so
        that it sees the status the caller gets, and inside `authenticate`, so that a request without
        a token makes none. ERROR only for a 5xx, the server's failure (a 400 or 404 was ERROR, as the
        exception behind it passed through). A caller that leaves is no failure of the server either:
        its span says so and stays unset (it was ERROR where the SDK marks a span its CancelledError
        leaves, as opentelemetry-sdk 1.31.0 did). A request the gateway ends itself, its caller still
        there, is its failure to answer: ERROR (it said the caller had left)."""
        if self.tracer is None or self._unauthenticated(request) is not None:
            return await handler(request)
        from opentelemetry import propagate, trace

        # Every value of a repeated header: the propagator treats a repeated traceparent as invalid.
        carrier = {name: request.headers.getall(name, []) for name in _PROPAGATED_HEADERS}
        context = propagate.extract(carrier)
        route = route_of(request)
        # `errors` answers every Exception (a bug as a 500): only the caller's leaving passes through.
        with self.tracer.start_as_current_span(
            span_name(request, route),
            context=context,
            kind=trace.SpanKind.SERVER,
            attributes=request_attributes(request, route),
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            try:
                response = await handler(request)
            except asyncio.CancelledError:  # aiohttp cancels the handler whose connection ended
                if is_left_by_caller(request):
                    span.set_attributes({TANDEM_CALLER_DISCONNECTED: True, **left_attributes(request)})
                else:  # the gateway ended it (shutdown past its grace, write timeout): its failure to answer
                    span.set_attributes(cut_attributes(request))
                    span.set_status(trace.StatusCode.ERROR, GATEWAY_CUT)
                raise
            span.set_attributes(response_attributes(response.status))
            if response.status >= 500:
                span.set_status(trace.StatusCode.ERROR)
            return response
