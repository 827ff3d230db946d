"""The gateway's HTTP connections: at most `max_connections` open, and a first request head in time.

NOTE: what a slow client costs. Each open connection holds a file descriptor, and aiohttp keeps one
that has not sent a whole request head waiting for an hour by default: 3,000 sockets trickling a
byte at a time stayed open 40 s (and would have for 3,630), so at a 1,024-descriptor limit about
1,000 of them lock every caller out. Here a connection beyond `max_connections` is answered 503 and
closed as soon as it is accepted (where no connection waiting for a request head gives its place up:
the NOTE below), and one whose first request head has not arrived within `header_timeout_s` is
closed. After a response, aiohttp's own keep-alive timeout (the gateway's
`idle_timeout_s`) closes a connection that stays idle, or trickles its next head, that long; a body
that stalls for `body_idle_timeout_s`, or is not whole within `body_timeout_s`, is the handler's 408,
its connection closed with the answer (body_intake.py).

NOTE: a caller that stops reading its answer. Writing waits on the socket's back-pressure alone
(aiohttp's writer awaits the transport's drain), and a peer that keeps its connection open but reads
nothing is never timed out by TCP: its handler, and a streamed answer's decoder calls, lived on until
max_tokens, holding their KV blocks and a stream of the caller's share, and a finished one held its
handler and its answer. An answer that ends with bytes still unsent, under aiohttp's 64 KiB high-water
mark (a 40 KiB answer through a 4 KiB send buffer; or a larger one read until writing resumed below
the 16 KiB low-water mark), never paused writing at all: its handler ended, and aiohttp's close (on
Connection: close, or its keep-alive timeout) waits for the unsent bytes to go, so the connection held
its descriptor and its place in `max_connections` for ever, a few KiB of unread answer each. So every
open connection's unsent bytes are looked at every quarter of `write_timeout_s`, paused or not; once a
connection has had bytes unsent and none taken at four looks in a row, it is aborted, which cancels its
handler and with it every gRPC call of its request (aiohttp's handler cancellation); it is aborted
within a quarter more than the bound after its caller's last byte taken. A look sees nothing taken when the
peer's TCP has acknowledged no byte since the last (Linux's tcpi_bytes_acked: a peer that reads nothing
acknowledges nothing once its receive buffer is full). The unsent bytes alone did not say: the kernel
takes MiBs of a connection's answer (a loopback send buffer grows to 4 MiB) and the transport hands it
more only once about half of them are gone, so a caller taking 640 KB/s of a stream was cut at a
0.5 s bound. Where the system does not count acknowledged bytes, a look sees nothing taken when the
unsent bytes are as many as at the last look, or more with writing paused since then (aiohttp's writer
waits on the drain then, after at most its next 64 KiB); writing resumed (under the low-water mark)
is bytes taken, and more unsent while writing was not paused means the handler is writing, which its
own bounds (max_tokens) end: the count starts again. As with nginx's send_timeout (60 s between two
writes that take anything), a caller taking bytes is not cut; an answer wholly in the kernel's buffer
is not looked at (aiohttp's keep-alive timeout closes its connection, the kernel keeping the bytes).

NOTE: why a connection at the bound closes another rather than being refused. 520 sockets from one
address that never sent a request head held all 512 places: every other caller, the kubelet's GET
/health among them, was answered 503 for the 10 s of `header_timeout_s`, and the sockets were renewed as
they were closed, so the kubelet's readiness probe would take the pod out of its Service. A place held
by a connection that waits for a request head (a first one, or the next on a keep-alive connection)
holds nothing of anyone's: so a new connection at the bound closes one of those, the one waiting longest
of the address that holds the most of them (the new one counted against its own), and is let in; only
where every connection is mid-request or mid-answer is it refused 503. Waiting is aiohttp's own reading,
the one its keep-alive timeout closes by: its handler awaits the next request head (`_waiter`, a private
name of its RequestHandler), with none queued; and nothing of an answer is left unsent in the transport.
A connection that has received nothing waits too, its handler run or not (accepted in the same pass of
the loop as the new one, it was not counted, and a caller among a burst of silent sockets was refused).
A head that arrived and a body, a handler, a stream or a lingering read under way are not waiting: never
closed so, nor is one whose bytes have arrived that the loop has not read yet (`_has_bytes`, looked at
for the one chosen alone). Waiting longest is waiting since the connection last received bytes or had
an answer written (`_Guarded.waits_since`; a silent socket: since it was made), as nginx takes the least
recently used of its keep-alive connections: by when each was opened, a pooled connection in steady
use, opened first, was closed first, and a request it sent as it was closed was lost. What remains: a
request sent on a connection chosen before its bytes arrive is lost with it (its caller sees the end of
a connection it reused, as at aiohttp's keep-alive timeout, and retries or fails: urllib3 does not retry
a POST); a head arriving in parts keeps none of its place (each part puts it last of its address's,
but a connection sending a byte now and then must not hold a place). An address is the health Watch
share's (`tandem.common.health.watcher_of`: an IPv4 address, an IPv6 /64), so whoever holds the most
waiting places gives them up first, one per new connection, and of addresses holding as many, the new
connection's own: sockets from one address renewed as fast as they are closed now close their own, and a
caller from another address is let in and answered (not counted, the newcomer lost every tie: one address
opening silent sockets took 5 of 8 places from another's pool of 6, and now takes 4). Behind one address
(a NAT, an ingress) callers alone keep every place as before, only a connection of theirs that waits is
closed for one of theirs that is new; nginx, out of connections, closes its keep-alive ones alike (its
reusable connections). The open connections are counted in one pass, kept for the next connections at
the bound while their address still leads (`_evict_one`). Each connection closed or refused so is
counted (`tandem.gateway.connections.evicted` and `.refused`: connection_metrics.py) and said in a
WARNING line at most every TELL_EVERY_S naming the address that lost the most (`_AtTheBound`). Where
aiohttp lays its handler out otherwise (no `_waiter`), only connections that received nothing are seen
waiting (test_connections' tests of a keep-alive place given up fail then).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import json
import logging
import resource
import select
import socket
import struct
import sys
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from tandem.client.errors import ConfigError
from tandem.common.health import watcher_of
from tandem.gateway.errors import HttpError
from tandem.gateway.parse_failures import NOT_HTTP, body_reason_of, reason_of

# aiohttp's lingering: what is left of a refused body read and dropped before its connection closes, so
# a client sending it whole (as http.client does, not waiting for `100 Continue`) reads the answer
# rather than a reset; cut from aiohttp's 10 s to a second, what a caller's slow upload may cost.
LINGERING_S = 1.0

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


# Looks at each connection's unsent bytes within one `write_timeout_s`.
NUM_WRITE_LOOKS = 4

# Linux's struct tcp_info: tcpi_bytes_acked, the bytes of ours the peer has acknowledged (since 4.1).
# FreeBSD's TCP_INFO lays its struct out otherwise: read on Linux alone.
TCP_INFO = getattr(socket, "TCP_INFO", None) if sys.platform == "linux" else None
BYTES_ACKED_OFFSET = 120

# How long a pass at the bound that found no connection waiting for a request head stands for those
# that an answer's unsent bytes held (`ConnectionGuard._evict_one`): nothing tells when they are gone.
NONE_WAITING_S = 0.1

# At most one WARNING line in this many seconds on connections closed or refused at the bound.
TELL_EVERY_S = 10.0

# Descriptors beside the connections and their decoder channels: the listener, the services'
# channels, the body workers' pipes, logs, imports.
SPARE_DESCRIPTORS = 64


def check_descriptors(max_connections: int, max_idle_channels: int) -> int:
    """The open files `max_connections` need (each connection, and the decoder channel of its caller,
    plus the idle channels kept); a hard limit below that is a ConfigError naming max_connections.
    Changes no limit: `tandem up` runs it before starting the gateway, which inherits its limits."""
    need = 2 * max_connections + max_idle_channels + SPARE_DESCRIPTORS
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < need:
        raise ConfigError(
            "max_connections",
            f"of {max_connections} needs about {need} open files, over this process's limit of {hard} "
            "(ulimit -Hn): lower it or raise the limit",
        )
    return need


def ensure_descriptors(max_connections: int, max_idle_channels: int) -> int:
    """Raise the soft limit on open files to what `check_descriptors` says `max_connections` need, up
    to the hard limit. Returns the limit now in force."""
    need = check_descriptors(max_connections, max_idle_channels)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= need:
        return soft
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    return need


def address_of(peername: object) -> str:
    """Whose share a connection from `peername` (a transport's: (host, port, ...)) counts against, read
    as the health Watch share reads a gRPC peer (`watcher_of`): an IPv4 address, an IPv6 /64."""
    if not isinstance(peername, tuple) or not peername or not isinstance(peername[0], str):
        return repr(peername)  # a Unix socket's path, or nothing: its own share
    host = peername[0]
    return watcher_of(f"ipv6:[{host}]:0" if ":" in host else f"ipv4:{host}:0")


class ConnectionGuard:
    """A protocol factory for `loop.create_server` around aiohttp's: counts the open connections and,
    at the bound, closes one that waits for a request head to let a new one in, or refuses the new one
    (the module's NOTE); closes one without a request head in time, and aborts one whose caller takes
    none of its answer for `write_timeout_s`. Event-loop thread only."""

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
        self.num_evicted = 0  # closed, waiting for a request head, to let a new connection in
        self.num_timed_out = 0
        self._open_ones: dict[asyncio.BaseTransport, _Guarded] = {}  # the connections counted, oldest first
        # The last pass's waiting connections of the address with the most, and its lead (`_evict_one`).
        self._victims: collections.deque[_Guarded] = collections.deque()
        self._lead = 0
        self._counted_at = 0.0  # when that pass was made (time.monotonic)
        self._none_waiting_until = 0.0  # a pass found none waiting: none is made again before then
        self._poll = select.poll()  # one connection's socket at a time (`_has_bytes`)
        self._at_the_bound = _AtTheBound(max_connections)
        self._waiting: dict[asyncio.BaseTransport, asyncio.TimerHandle] = {}  # no request head yet
        self._writes: dict[asyncio.BaseTransport, _Writes] = {}  # every open connection's
        self._looks: asyncio.TimerHandle | None = None  # the next look at them, while any is open

    def __call__(self) -> asyncio.Protocol:
        return _Guarded(self)

    def head_received(self, transport: asyncio.BaseTransport | None) -> None:
        """A request head arrived on `transport` (called for every request; only a first one counts)."""
        timer = self._waiting.pop(transport, None) if transport is not None else None
        if timer is not None:
            timer.cancel()

    def _open(self, guarded: _Guarded, transport: asyncio.BaseTransport) -> asyncio.Protocol | None:
        """aiohttp's protocol for a new connection, or None (and the connection refused) at the bound
        with no connection waiting for a request head to close in its place."""
        if self.num_open >= self.max_connections and not self._evict_one(guarded):
            self.num_refused += 1
            self._at_the_bound.refused(guarded.address)
            assert isinstance(transport, asyncio.WriteTransport)
            transport.write(REFUSAL)
            transport.close()
            return None
        self.num_open += 1
        self._open_ones[transport] = guarded
        self.may_wait()  # this one, until it sends a head
        loop = asyncio.get_running_loop()
        self._waiting[transport] = loop.call_later(self.header_timeout_s, self._no_head, transport)
        assert isinstance(transport, asyncio.WriteTransport)
        self._writes[transport] = _Writes(transport)
        if self._looks is None:
            self._looks = loop.call_later(self.write_timeout_s / NUM_WRITE_LOOKS, self._look)
        return self._protocol()

    def may_wait(self) -> None:
        """A connection may wait for a request head from now (let in, or its answer written): the next
        connection at the bound counts the waiting ones again, where the last count found none."""
        self._none_waiting_until = 0.0

    def _evict_one(self, newcomer: _Guarded) -> bool:
        """Closes the connection waiting longest for a request head of the address that has the most
        of them, `newcomer` counted against its own; False where none waits (the module's NOTE).

        NOTE: why a pass is not made for every connection. A pass over 512 connections cost about
        0.25 ms of CPU: a connection at the bound took 0.49-0.51 ms (this process's, its client's
        included), a refusal 0.14-0.22 ms, and sockets from one address renewed as fast as they are
        closed paid it each time. So a pass keeps the heaviest address's other waiting connections
        (`_victims`, waiting longest first) and its lead over the next address, the new connection
        counted against its own: each connection closed from them since takes 1 from the lead, and each
        new one may add 1 to another address, so they are still strictly the most while the lead is 1
        or more, and it is spent 2 at a time (1 for one found no longer waiting, or used since the
        count). A lead of 510 serves 255 connections on one pass. What the pass did not see are
        connections of other addresses that went on to wait since: they are counted at the next pass,
        made once the lead is spent or a connection closes of itself. A pass that finds none waiting is
        not made again (each refusal paid it: 0.155-0.175 ms of the gateway's CPU a refusal, 512
        connections held mid-request, against 0.065-0.072 before any place was given up, and 0.073-0.092
        now, on one host) until a connection may wait (`may_wait`: one let in, one whose answer was
        written, one closed), or for `NONE_WAITING_S` (an answer's unsent bytes gone, which nothing
        tells)."""
        now = time.monotonic()
        if now < self._none_waiting_until:
            return False
        while self._lead >= 1 and self._victims:
            guarded = self._victims.popleft()
            if (
                guarded.waits_since <= self._counted_at
                and guarded.transport in self._open_ones
                and guarded.awaits_request()
                and not self._has_bytes(guarded)
            ):
                self._lead -= 2
                self._evict(guarded)
                return True
            self._lead -= 1
        # Each address's waiting connections, the new connection's address first: of addresses with as
        # many (it counted), its own gives one up.
        waiting: dict[str, list[_Guarded]] = {newcomer.address: []}
        for guarded in self._open_ones.values():
            if guarded.awaits_request():
                waiting.setdefault(guarded.address, []).append(guarded)
        counts = sorted(
            ((len(ones) + (address == newcomer.address), ones) for address, ones in waiting.items()),
            key=_count_of,
            reverse=True,
        )
        # The first with one waiting: the new one's address counts 1 with none of its own waiting, and
        # then the next has 1 too, or none waits.
        chosen = next((i for i, (_, ones) in enumerate(counts) if ones), None)
        if chosen is None:
            self._none_waiting_until = now + NONE_WAITING_S
            return False
        count, most = counts[chosen]
        lead = count - max((other for i, (other, _) in enumerate(counts) if i != chosen), default=0)
        most.sort(key=_waits_since)  # waiting longest first
        for i, guarded in enumerate(most):
            if not self._has_bytes(guarded):  # else its next head arrived, not yet read: not waiting
                self._victims = collections.deque(most[i + 1 :])
                self._lead = lead - i - 2  # this one closed, one let in
                self._counted_at = now
                self._evict(guarded)
                return True
        self._victims.clear()
        self._lead = 0
        return False  # every one of them has bytes arrived: rare, and a new pass comes next time

    def _has_bytes(self, guarded: _Guarded) -> bool:
        """Whether bytes (or an end) from `guarded`'s caller arrived that the loop has not read yet: a
        request sent as the count was made, which closing it would lose."""
        sock = guarded.transport.get_extra_info("socket") if guarded.transport is not None else None
        if sock is None:
            return False
        fd = sock.fileno()
        if fd < 0:
            return False
        self._poll.register(fd, select.POLLIN)
        try:
            return bool(self._poll.poll(0))
        finally:
            self._poll.unregister(fd)

    def _evict(self, guarded: _Guarded) -> None:
        transport = guarded.transport
        assert transport is not None
        self._forget(transport)  # its place is the new connection's now, not once its close completes
        self.num_evicted += 1
        self._at_the_bound.evicted(guarded.address)
        transport.close()  # nothing of it is unsent: its caller reads an end, then a closed connection

    def _look(self) -> None:
        for transport, writes in list(self._writes.items()):
            if writes.look():
                del self._writes[transport]  # aborted: looked at no more
                self._write_stalled(writes.transport)
        self._looks = None
        if self._writes:
            self._looks = asyncio.get_running_loop().call_later(
                self.write_timeout_s / NUM_WRITE_LOOKS, self._look
            )

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
        if transport in self._open_ones:  # else closed to let another in, and forgotten then
            self._forget(transport)
            # A place is free: the next connection closes none, and the one after counts afresh.
            self._victims.clear()
            self._lead = 0
            self.may_wait()

    def _forget(self, transport: asyncio.BaseTransport) -> None:
        """`transport` no longer counted among the open connections, nor timed, nor looked at."""
        del self._open_ones[transport]
        self.num_open -= 1
        timer = self._waiting.pop(transport, None)
        if timer is not None:
            timer.cancel()
        self._writes.pop(transport, None)
        if not self._writes and self._looks is not None:
            self._looks.cancel()
            self._looks = None


class _Guarded(asyncio.Protocol):
    """aiohttp's protocol, every event passed on, once the guard has let the connection in (the check
    is made as each connection is made, so a burst of accepts cannot pass the bound together)."""

    def __init__(self, guard: ConnectionGuard) -> None:
        self._guard = guard
        self._inner: asyncio.Protocol | None = None  # None: refused
        self.transport: asyncio.BaseTransport | None = None
        self._writes: _Writes | None = None  # the guard's look at its unsent bytes, once let in
        # When it last did anything but wait (time.monotonic): made, bytes received, an answer written.
        # Waiting for a head now, it has waited since then: a silent socket since it was made.
        self.waits_since = time.monotonic()
        self._heard = False  # any byte received

    @functools.cached_property
    def address(self) -> str:
        """Whose share it counts against (`address_of`), read once made. Worked out when first asked, at
        the bound only: on every connection it cost 4.9 us (IPv4) to 24 us (IPv6) of the loop's ~300."""
        assert self.transport is not None
        return address_of(self.transport.get_extra_info("peername"))

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self._inner = self._guard._open(self, transport)
        if self._inner is not None:
            self._writes = self._guard._writes[transport]
            if isinstance(self._inner, OpenAIRequestHandler):
                self._inner.answered = self._answered
            self._inner.connection_made(transport)

    def _answered(self) -> None:
        self.waits_since = time.monotonic()
        self._guard.may_wait()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._inner is not None and self.transport is not None:
            self._guard._closed(self.transport)
            self._inner.connection_lost(exc)

    def awaits_request(self) -> bool:
        """Whether aiohttp's handler waits for a request head, none queued, with nothing of an answer
        unsent: its keep-alive timeout's own reading of idle (the module's NOTE)."""
        transport = self.transport
        if (
            not isinstance(transport, asyncio.WriteTransport)
            or transport.is_closing()
            or transport.get_write_buffer_size()
        ):
            return False
        waiter = getattr(self._inner, "_waiter", None)
        if isinstance(waiter, asyncio.Future):
            return not waiter.done()
        # No waiter: its handler has not run yet (let in this pass of the loop), or is handling a request.
        # One that has received nothing waits for its first head either way.
        return not self._heard

    def data_received(self, data: bytes) -> None:
        if self._inner is not None:
            self._heard = True
            self.waits_since = time.monotonic()
            self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._inner is not None else None

    def pause_writing(self) -> None:
        if self._inner is not None and self._writes is not None:
            self._writes.pause()
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is not None and self._writes is not None:
            self._writes.resume()
            self._inner.resume_writing()


def _count_of(entry: tuple[int, list[_Guarded]]) -> int:
    return entry[0]


def _waits_since(guarded: _Guarded) -> float:
    return guarded.waits_since


class _AtTheBound:
    """The connections closed and refused at the bound said in one WARNING line at most every
    TELL_EVERY_S: the first at once, those after it in the line at the end of that time (the counts
    since the last line, and the address that lost the most connections or was refused the most)."""

    def __init__(self, max_connections: int) -> None:
        self._max_connections = max_connections
        self._evicted: collections.Counter[str] = collections.Counter()  # since the last line, by address
        self._refused: collections.Counter[str] = collections.Counter()
        self._next: asyncio.TimerHandle | None = None  # the end of the last line's TELL_EVERY_S

    def evicted(self, address: str) -> None:
        self._evicted[address] += 1
        self._told()

    def refused(self, address: str) -> None:
        self._refused[address] += 1
        self._told()

    def _told(self) -> None:
        if self._next is None:
            self._tell()

    def _tell(self) -> None:
        if not self._evicted and not self._refused:
            self._next = None  # quiet since the last line: the next event is said at once
            return
        parts = []
        for counted, what, whose in (
            (self._evicted, "connections waiting for a request head closed for new ones", "of"),
            (self._refused, "new connections refused 503, none waiting", "from"),
        ):
            if counted:
                address, most = counted.most_common(1)[0]
                parts.append(f"{counted.total()} {what} (most {whose} {address}: {most})")
        log.warning(
            "at --max-connections %d since the last such line: %s", self._max_connections, "; ".join(parts)
        )
        self._evicted.clear()
        self._refused.clear()
        self._next = asyncio.get_running_loop().call_later(TELL_EVERY_S, self._tell)


class _Writes:
    """One connection's unsent bytes as the guard last looked at them: `look` says when no byte has
    been taken at NUM_WRITE_LOOKS looks in a row while some were unsent (the module's NOTE)."""

    def __init__(self, transport: asyncio.WriteTransport) -> None:
        self.transport = transport
        self._paused = False  # aiohttp's transport has paused writing (over its high-water mark)
        self._resumed = False  # writing was resumed since the last look: the caller took bytes
        self._paused_at_look = False
        self._unsent = 0
        self._acked = _bytes_acked(transport)
        self._num_still = 0  # looks in a row that saw nothing taken

    def pause(self) -> None:
        self._paused = True

    def resume(self) -> None:
        self._paused, self._resumed = False, True

    def look(self) -> bool:
        unsent, acked = self.transport.get_write_buffer_size(), _bytes_acked(self.transport)
        if acked is not None and self._acked is not None:
            still = unsent > 0 and acked == self._acked
        else:  # no count of bytes taken: as many unsent as at the last look, or more while paused
            paused_throughout = self._paused and self._paused_at_look and not self._resumed
            still = unsent > 0 and (unsent == self._unsent or (paused_throughout and unsent > self._unsent))
            still = still and not self._resumed
        self._num_still = self._num_still + 1 if still else 0
        self._unsent, self._acked = unsent, acked
        self._paused_at_look, self._resumed = self._paused, False
        return self._num_still >= NUM_WRITE_LOOKS


def _bytes_acked(transport: asyncio.WriteTransport) -> int | None:
    """The bytes of ours the peer's TCP has acknowledged, or None where the system does not say."""
    sock = transport.get_extra_info("socket")
    if TCP_INFO is None or sock is None:
        return None
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, TCP_INFO, BYTES_ACKED_OFFSET + 8)
    except OSError:  # not TCP (a test's socket pair), or closed under us
        return None
    if len(info) < BYTES_ACKED_OFFSET + 8:  # a kernel before 4.1
        return None
    return struct.unpack_from("=Q", info, BYTES_ACKED_OFFSET)[0]


class OpenAIRequestHandler(web.RequestHandler):
    """aiohttp's protocol for one connection, its own answers in OpenAI's error shape: a request it
    cannot parse (a request line or a header that is not HTTP, a chunk size not hex, Content-Length
    beside Transfer-Encoding) got aiohttp's plain-text 400, which an OpenAI client reports as an
    unparsable body rather than the error. `handle_error` is the one method aiohttp answers all of these
    with, a public one of aiohttp.web's RequestHandler (no private state is touched); aiohttp's own
    still runs first, so it still logs (ServerLog) and still refuses to answer after bytes were sent.
    Its parser tells a body being read that its framing failed (`_BodyFailures`), and decodes no body
    (body_codings' NOTE: the handler that reads one decodes it). It tells whether its caller ended the
    connection (`is_left_by_caller`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **(kwargs | {"auto_decompress": False}))
        # aiohttp cancels a handler alike when its caller goes and when the gateway ends the connection
        # itself (its shutdown past the grace, a write timeout's abort), and by then its transport is gone
        # either way: what ended the connection is seen here, as it ends.
        self.is_left_by_caller = False
        # Told when an answer is written, the connection then waiting for its next head or lingering
        # (`_Guarded`: how long a connection has waited).
        self.answered: Callable[[], None] | None = None
        # A private name: an aiohttp without it (a later release) keeps its own parser and the 408 of old,
        # rather than a gateway that cannot take a connection (test_body_timeouts tells which it is).
        parser = getattr(self, "_parser", None)
        if callable(getattr(parser, "feed_data", None)):
            self._parser = _BodyFailures(parser)

    async def finish_response(
        self, request: web.BaseRequest, resp: web.StreamResponse, start_time: float | None
    ) -> tuple[web.StreamResponse, bool]:
        try:
            return await super().finish_response(request, resp, start_time)
        finally:
            if self.answered is not None:
                self.answered()

    def eof_received(self) -> None:
        self.is_left_by_caller = True  # the caller's FIN: the transport closes the connection on it
        return super().eof_received()

    def connection_lost(self, exc: BaseException | None) -> None:
        # A reset or a broken pipe is the caller's, or its network's; the gateway's own close and abort
        # give None.
        if isinstance(exc, OSError):
            self.is_left_by_caller = True
        super().connection_lost(exc)

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        plain = super().handle_error(request, status, exc, message)
        if plain.status < 500:
            if isinstance(exc, HttpProcessingError):
                reason = reason_of(exc)  # never the bytes it failed on: a token (parse_failures.py)
            else:
                reason = " ".join(str(message or plain.reason).split())[:200]
            # NOT_HTTP is a reason too, a failure of no kind named (too many header lines): said once.
            message = reason if reason == NOT_HTTP else f"{NOT_HTTP}: {reason}"
            error = HttpError(plain.status, "invalid_request_error", message)
        else:  # a handler's failure the middlewares did not answer (they answer every one but a cancel)
            error = HttpError(plain.status, "server_error", "the gateway failed on this request")
        response = web.json_response(error.body(), status=error.status, headers=error.headers())
        response.force_close()  # as aiohttp's: what follows on the connection cannot be trusted
        return response


def is_left_by_caller(request: web.BaseRequest) -> bool:
    """Whether `request`'s caller ended its connection, as its OpenAIRequestHandler saw (`tandem serve
    openai` serves every connection so). Under another protocol, False: aiohttp's own cancels no handler
    its caller leaves unless asked to (handler_cancellation), but does at shutdown."""
    protocol = request.protocol
    return isinstance(protocol, OpenAIRequestHandler) and protocol.is_left_by_caller


class _BodyFailures:
    """aiohttp's request parser, a failure of a body's framing (a chunk size that is not hex, after
    chunks that were) given to that body, as the body's own failures are (a Content-Encoding that does
    not decode).

    NOTE: why a handler reading such a body waited. aiohttp's C parser (the one it uses where it is
    built) raises the failure to its protocol and forgets the body, whose reader is told nothing: the
    protocol queues a 400 to answer after the request being handled, whose handler waited for more of
    its body until --body-idle-timeout-s and answered 408 (1.5 s there), the 400 never sent. Its pure
    Python parser gives the failure to the body too; so does this, the handler answering 400 at once
    (body_intake.py). aiohttp keeps its parser in a private attribute, one of the two private names the
    gateway uses (the other: its handler's `_waiter`, the module's NOTE on a connection at the bound)."""

    def __init__(self, parser: Any) -> None:
        self._parser = parser
        self._body: Any = None  # the body of the last request head parsed, a StreamReader

    def feed_data(self, data: bytes) -> Any:
        try:
            messages, upgraded, tail = self._parser.feed_data(data)
        except HttpProcessingError as error:
            body, self._body = self._body, None
            if body is not None and not body.is_eof() and body.exception() is None:
                body.set_exception(error)
            raise
        if messages:
            self._body = messages[-1][1]
        return messages, upgraded, tail

    def __getattr__(self, name: str) -> Any:
        return getattr(self._parser, name)


class ServerLog(logging.LoggerAdapter):
    """aiohttp's server log (its `logger`), where a request that is not HTTP as it must be (a chunk size
    that is not hex, Content-Length beside Transfer-Encoding, a header line too long) is one INFO line
    naming the caller and the reason: aiohttp logs each as an ERROR with its parser's traceback, about
    twenty lines a caller can have written for every 100 bytes it sends. The caller gets a 400 in OpenAI's
    shape (OpenAIRequestHandler). Neither says the bytes the parser failed on (`parse_failures`: a
    header line over its bound quoted a bearer token's first 100 bytes).

    NOTE: a body that fails while aiohttp drains it after the answer (its lingering read) is one such
    line too: aiohttp logs it as "Unhandled exception" with chained tracebacks, about 25 lines a request
    (a plain body labelled gzip after a 401 was one, while aiohttp's parser decoded bodies: body_codings'
    NOTE), and closes that connection itself: only the log line changes."""

    def __init__(self) -> None:
        super().__init__(logging.getLogger("aiohttp.server"), {})

    def log(self, level: int, msg: object, *args: Any, **kwargs: Any) -> None:
        error = kwargs.get("exc_info")
        if level >= logging.ERROR and isinstance(error, RequestPayloadError):  # the drain's (NOTE)
            reason = body_reason_of(error)
            level, msg, args = logging.INFO, "a body drained after its answer failed: %s", (reason,)
            kwargs["exc_info"] = None
        elif isinstance(error, HttpProcessingError) and error.code < 500:
            # At DEBUG too (aiohttp's level for a first request's bad method): its traceback quoted
            # the bytes as well.
            level, msg, args = min(level, logging.INFO), f"{msg}: %s", (*args, reason_of(error))
            kwargs["exc_info"] = None
        super().log(level, msg, *args, **kwargs)
