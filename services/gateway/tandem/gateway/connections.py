"""The gateway's HTTP connections: at most `max_connections` open, and a first request head in time.

NOTE: what a slow client costs. Each open connection holds a file descriptor, and aiohttp keeps one
that has not sent a whole request head waiting for an hour by default: 3,000 sockets trickling a
byte at a time stayed open 40 s (and would have for 3,630), so at a 1,024-descriptor limit about
1,000 of them lock every caller out. Here a connection beyond `max_connections` is answered 503 and
closed as soon as it is accepted, and one whose first request head has not arrived within
`header_timeout_s` is closed. After a response, aiohttp's own keep-alive timeout (the gateway's
`idle_timeout_s`) closes a connection that stays idle, or trickles its next head, that long; a body
that stalls for `body_idle_timeout_s`, or is not whole within `body_timeout_s`, is the handler's 408,
its connection closed with the answer (app.py).

NOTE: a caller that stops reading its answer. Writing waits on the socket's back-pressure alone
(aiohttp's writer awaits the transport's drain), and a peer that keeps its connection open but reads
nothing is never timed out by TCP: its handler, and a streamed answer's decoder calls, lived on until
max_tokens, holding their KV blocks and a stream of the caller's share, and a finished one held its
handler and its answer. While aiohttp's transport holds more than its high-water mark unsent (its
`pause_writing`), the connection's unsent bytes are looked at every quarter of `write_timeout_s`; once
they have not gone down at four looks in a row, the connection is aborted, which cancels its handler
and with it every gRPC call of its request (aiohttp's handler cancellation). As with nginx's
send_timeout (60 s between two writes that take anything), a caller taking bytes is not cut: only
until aiohttp's writer waits on its drain (after its next 64 KiB, or one larger write) can a look see
more added than was taken.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from tandem.client.errors import ConfigError
from tandem.gateway.errors import HttpError

log = logging.getLogger("tandem.gateway")

REFUSAL_BODY = json.dumps(
    {
        "error": {
            "message": "the gateway has too many open connections (--max-connections); retry",
            "type": "service_unavailable",
            "param": None,
            "code": "service_unavailable",
        }
    }
).encode()
REFUSAL = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
    b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(REFUSAL_BODY)
) + REFUSAL_BODY


# Looks at a paused connection's unsent bytes within one `write_timeout_s`.
NUM_WRITE_LOOKS = 4

# Descriptors beside the connections and their decoder channels: the listener, the services'
# channels, the body workers' pipes, logs, imports.
SPARE_DESCRIPTORS = 64


def ensure_descriptors(max_connections: int, max_idle_channels: int) -> int:
    """Raise the soft limit on open files to what `max_connections` need (each connection, and the
    decoder channel of its caller, plus the idle channels kept), up to the hard limit; a hard limit
    below that is a ConfigError naming max_connections. Returns the limit now in force."""
    need = 2 * max_connections + max_idle_channels + SPARE_DESCRIPTORS
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= need:
        return soft
    if hard != resource.RLIM_INFINITY and hard < need:
        raise ConfigError(
            "max_connections",
            f"of {max_connections} needs about {need} open files, over this process's limit of {hard} "
            "(ulimit -Hn): lower it or raise the limit",
        )
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    return need


class ConnectionGuard:
    """A protocol factory for `loop.create_server` around aiohttp's: counts the open connections and
    refuses those beyond the bound; closes one without a request head in time, and aborts one whose
    caller takes none of its answer for `write_timeout_s`. Event-loop thread only."""

    def __init__(
        self,
        protocol: Callable[[], asyncio.Protocol],
        max_connections: int,
        header_timeout_s: float,
        write_timeout_s: float,
    ) -> None:
        self._protocol = protocol  # aiohttp's: one RequestHandler per connection
        self.max_connections = max_connections
        self.header_timeout_s = header_timeout_s
        self.write_timeout_s = write_timeout_s
        self.num_open = 0
        self.num_refused = 0
        self.num_timed_out = 0
        self._waiting: dict[asyncio.BaseTransport, asyncio.TimerHandle] = {}  # no request head yet

    def __call__(self) -> asyncio.Protocol:
        return _Guarded(self)

    def head_received(self, transport: asyncio.BaseTransport | None) -> None:
        """A request head arrived on `transport` (called for every request; only a first one counts)."""
        timer = self._waiting.pop(transport, None) if transport is not None else None
        if timer is not None:
            timer.cancel()

    def _open(self, transport: asyncio.BaseTransport) -> asyncio.Protocol | None:
        """aiohttp's protocol for a new connection, or None (and the connection refused) over the bound."""
        if self.num_open >= self.max_connections:
            self.num_refused += 1
            assert isinstance(transport, asyncio.WriteTransport)
            transport.write(REFUSAL)
            transport.close()
            return None
        self.num_open += 1
        loop = asyncio.get_running_loop()
        self._waiting[transport] = loop.call_later(self.header_timeout_s, self._no_head, transport)
        return self._protocol()

    def _no_head(self, transport: asyncio.BaseTransport) -> None:
        if self._waiting.pop(transport, None) is not None:
            self.num_timed_out += 1
            transport.close()

    def _write_stalled(self, transport: asyncio.WriteTransport) -> None:
        peer = transport.get_extra_info("peername")
        caller = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else "a caller"
        log.info(
            "closed the connection of %s: it took none of its answer for %g s (--write-timeout-s)",
            caller,
            self.write_timeout_s,
        )
        transport.abort()  # close() would wait for the unsent bytes to go, which they never will

    def _closed(self, transport: asyncio.BaseTransport) -> None:
        self.num_open -= 1
        timer = self._waiting.pop(transport, None)
        if timer is not None:
            timer.cancel()


class _Guarded(asyncio.Protocol):
    """aiohttp's protocol, every event passed on, once the guard has let the connection in (the check
    is made as each connection is made, so a burst of accepts cannot pass the bound together)."""

    def __init__(self, guard: ConnectionGuard) -> None:
        self._guard = guard
        self._inner: asyncio.Protocol | None = None  # None: refused
        self._transport: asyncio.BaseTransport | None = None
        self._stall: _WriteStall | None = None  # while aiohttp's transport has paused our writing

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport
        self._inner = self._guard._open(transport)
        if self._inner is not None:
            self._inner.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._inner is not None and self._transport is not None:
            self._guard._closed(self._transport)
            if self._stall is not None:
                self._stall.cancel()
            self._inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._inner is not None:
            self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._inner is not None else None

    def pause_writing(self) -> None:
        if self._inner is not None:
            assert isinstance(self._transport, asyncio.WriteTransport)
            self._stall = _WriteStall(
                self._transport, self._guard.write_timeout_s, self._guard._write_stalled
            )
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is not None:
            if self._stall is not None:
                self._stall.cancel()
                self._stall = None
            self._inner.resume_writing()


class _WriteStall:
    """A paused connection's unsent bytes, looked at NUM_WRITE_LOOKS times a `timeout_s`: `on_stall`
    once they have not gone down at any of that many looks in a row."""

    def __init__(
        self,
        transport: asyncio.WriteTransport,
        timeout_s: float,
        on_stall: Callable[[asyncio.WriteTransport], None],
    ) -> None:
        self._transport = transport
        self._on_stall = on_stall
        self._every_s = timeout_s / NUM_WRITE_LOOKS
        self._unsent = transport.get_write_buffer_size()
        self._num_still = 0  # looks in a row that saw nothing taken
        self._timer = asyncio.get_running_loop().call_later(self._every_s, self._look)

    def _look(self) -> None:
        unsent = self._transport.get_write_buffer_size()
        self._num_still = 0 if unsent < self._unsent else self._num_still + 1
        self._unsent = unsent
        if self._num_still >= NUM_WRITE_LOOKS:
            self._on_stall(self._transport)
        else:
            self._timer = asyncio.get_running_loop().call_later(self._every_s, self._look)

    def cancel(self) -> None:
        self._timer.cancel()


class OpenAIRequestHandler(web.RequestHandler):
    """aiohttp's protocol for one connection, its own answers in OpenAI's error shape: a request it
    cannot parse (a request line or a header that is not HTTP, a chunk size not hex, Content-Length
    beside Transfer-Encoding) got aiohttp's plain-text 400, which an OpenAI client reports as an
    unparsable body rather than the error. `handle_error` is the one method aiohttp answers all of these
    with, a public one of aiohttp.web's RequestHandler (no private state is touched); aiohttp's own
    still runs first, so it still logs (ServerLog) and still refuses to answer after bytes were sent."""

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        plain = super().handle_error(request, status, exc, message)
        if plain.status < 500:
            reason = " ".join(str(message or plain.reason).split())[:200]
            error = HttpError(
                plain.status, "invalid_request_error", f"the request is not HTTP as it must be: {reason}"
            )
        else:  # a handler's failure the middlewares did not answer (they answer every one but a cancel)
            error = HttpError(plain.status, "server_error", "the gateway failed on this request")
        response = web.json_response(error.body(), status=error.status)
        response.force_close()  # as aiohttp's: what follows on the connection cannot be trusted
        return response


class ServerLog(logging.LoggerAdapter):
    """aiohttp's server log (its `logger`), where a request that is not HTTP as it must be (a chunk size
    that is not hex, Content-Length beside Transfer-Encoding, a header line too long) is one INFO line
    naming the caller and the reason: aiohttp logs each as an ERROR with its parser's traceback, about
    twenty lines a caller can have written for every 100 bytes it sends. The caller gets a 400 in OpenAI's
    shape (OpenAIRequestHandler)."""

    def __init__(self) -> None:
        super().__init__(logging.getLogger("aiohttp.server"), {})

    def log(self, level: int, msg: object, *args: Any, **kwargs: Any) -> None:
        error = kwargs.get("exc_info")
        if level >= logging.ERROR and isinstance(error, HttpProcessingError) and error.code < 500:
            reason = " ".join(str(error.message).split())[:200]
            level, msg, args = logging.INFO, f"{msg}: %s", (*args, reason)
            kwargs["exc_info"] = None
        super().log(level, msg, *args, **kwargs)
