"""A request's body taken in: read within its bounds (its size, the time it takes to arrive, the width
of its JSON), a large one holding a place among the large bodies from its first bytes, then converted to
the call it asks for (in a worker process when large: `bodies.py`). What the intake leaves on the request
(its keys below) is read again once the request ends: its place given back, its heap too.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from aiohttp import StreamReader, web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from tandem.gateway.bodies import BodyWorkers, Convert, LargeBodies, LargeBody, convert
from tandem.gateway.body_codings import DecodedBody, coding_of, coding_refusal, is_body_left
from tandem.gateway.body_limits import BodyLimits, count_values
from tandem.gateway.calls import EmbedCall, GenerateCall
from tandem.gateway.config import GatewayConfig
from tandem.gateway.errors import BodyNames, HttpError, Refused
from tandem.gateway.log_text import printable
from tandem.gateway.parse_failures import body_reason_of

LARGE_BODY = web.RequestKey("large_body", LargeBody)  # this request's place among the large bodies
WAS_LARGE = web.RequestKey("was_large", bool)  # it held one: give the heap back when it ends
BODY_NAMES = web.RequestKey("body_names", BodyNames)  # the body's names for fields an error may name
DECODED_BODY = web.RequestKey("decoded_body", DecodedBody)  # a coded body's reader: what is left of it


class BodyIntake:
    """The gateway's request bodies: each read within its bounds and converted, the large ones each
    holding a place while read."""

    def __init__(
        self, config: GatewayConfig, workers: BodyWorkers, caller: Callable[[web.Request], str]
    ) -> None:
        self.config = config
        self.workers = workers
        self.caller = caller  # who sends a request (its token, else its address): a share of the places each
        self.large_bodies = LargeBodies(config.max_large_bodies, config.max_large_bodies_per_caller)

    async def convert(
        self, request: web.Request, to_call: Convert, limits: BodyLimits
    ) -> GenerateCall | EmbedCall:
        """The body, read and converted: in a worker process when it is large (`bodies.py`)."""
        raw = await self._read(request, limits)
        if len(raw) < self.config.large_body_bytes:
            call = convert(to_call, raw, limits)
        else:
            call = await self.workers.convert(to_call, raw, limits)
        if isinstance(call, GenerateCall):
            request[BODY_NAMES] = call.names
        return call

    async def _read(self, request: web.Request, limits: BodyLimits) -> bytearray:
        """The body's bytes: at most --max-body-bytes (413), within --body-timeout-s (408), its JSON
        values counted as they come (`count_values`: 400 naming the field before the rest is read); a
        large one holds a place among --max-large-bodies (503 when none is free), and among its
        caller's --max-large-bodies-per-caller (429), from its first bytes: a head alone, however large
        the length it declares, holds none (`take_large_body`).

        Read into one buffer, each chunk copied in as it arrives: holding the chunks and joining them
        left the heap grown by the body's size after it was freed (glibc keeps a freed heap's middle),
        where one buffer this large is its own mapping, given back whole."""
        limit = self.config.max_body_bytes
        declared = request.content_length
        if declared is not None and declared > limit:
            raise Refused(too_large_body(limit))
        if (refusal := coding_refusal(request.headers)) is not None:
            raise Refused(refusal)
        is_large = declared is not None and declared >= self.config.large_body_bytes
        body, num_values = bytearray(), 0
        # Two bounds on one timer: the next bytes within --body-idle-timeout-s, all of them by the
        # --body-timeout-s deadline.
        loop = asyncio.get_running_loop()
        idle_s, deadline = self.config.body_idle_timeout_s, loop.time() + self.config.body_timeout_s

        def on_coded(num_coded: int) -> None:
            # A coded body is bounded as sent too, as a declared length is (DecodedBody's NOTE), and each
            # coded piece is its caller's progress, whatever it decodes to.
            if num_coded > limit:
                raise Refused(too_large_body(limit))
            timer.reschedule(min(deadline, loop.time() + idle_s))

        content: DecodedBody | StreamReader = request.content
        if (coding := coding_of(request.headers)) is not None:
            content = request[DECODED_BODY] = DecodedBody(request.content, coding, on_coded)
        try:
            async with asyncio.timeout_at(min(deadline, loop.time() + idle_s)) as timer:
                while chunk := await content.readany():
                    if len(body) + len(chunk) > limit:
                        raise Refused(too_large_body(limit))
                    if LARGE_BODY not in request and (
                        is_large or len(body) + len(chunk) >= self.config.large_body_bytes
                    ):
                        self.take_large_body(request)
                    body += chunk
                    num_values = count_values(body, limits, len(body) - len(chunk), num_values)
                    timer.reschedule(min(deadline, loop.time() + idle_s))
                    # A turn for the loop's other callers between pieces: a coded body's next piece is
                    # decoded from bytes already come, so `readany` gives it without waiting, and 64 KiB
                    # of gzip held the loop while it decoded to 64 MiB (730-840 ms; 25-69 ms plain).
                    await asyncio.sleep(0)
        except TimeoutError:
            came = f"{len(body)} bytes" + (f" of {declared}" if declared is not None else "") + " came"
            if loop.time() >= deadline:
                bound = f"was not whole within {self.config.body_timeout_s:g} s (--body-timeout-s)"
            else:
                bound = f"sent nothing for {idle_s:g} s (--body-idle-timeout-s)"
            message = f"the body {bound}; {came}"
            raise Refused(HttpError(408, "invalid_request_error", message, "body"), close=True) from None
        except (RequestPayloadError, HttpProcessingError) as error:  # the caller's bytes, not our bug: a 400
            # Its reason, never aiohttp's message: a chunk-size or trailer line's failure quoted the
            # caller's bytes, a token among them (parse_failures.py).
            encoding = request.headers.get("Content-Encoding")
            sent = f" (Content-Encoding: {printable(encoding[:32])})" if encoding else ""
            message = f"the body could not be read as sent{sent}: {body_reason_of(error)}"
            raise Refused(HttpError(400, "invalid_request_error", message, "body")) from None
        return body

    def take_large_body(self, request: web.Request) -> None:
        """A place among the large bodies for `request`, its caller's.

        NOTE: why a body's place is taken with its first bytes, not with its head. The place bounds the
        memory of bodies being read, and a head holds none: taken with the head, a caller sending heads
        alone (each declaring 1 MiB) held every place for --body-idle-timeout-s, at the cost of a few
        hundred bytes. Its first bytes still come before any memory worth bounding does. A caller that
        trickles its bodies holds its places until --body-timeout-s, so each caller's places are bounded
        too (--max-large-bodies-per-caller): what one caller holds, the others still have. No minimum
        rate (Apache's mod_reqtimeout MinRate): any floor that an honest picture over a slow uplink
        passes, a trickle passes too, holding its place to --body-timeout-s all the same; only the share
        keeps it from the others."""
        request[LARGE_BODY] = self.large_bodies.take(self.caller(request))
        request[WAS_LARGE] = True


def has_body_left(request: web.Request) -> bool:
    """Whether some of `request`'s body is left unread, by its decoding reader where it has one: its
    coded bytes may all have come with much of them still to decode."""
    return is_body_left(request.get(DECODED_BODY, request.content))


def too_large_body(limit: int) -> HttpError:
    return HttpError(
        413, "invalid_request_error", f"the request body is over {limit} bytes (--max-body-bytes)", "body"
    )
