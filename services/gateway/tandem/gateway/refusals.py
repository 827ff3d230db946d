"""How the gateway answers a refusal: an `HttpError` as OpenAI's JSON, and, where the refusal leaves a
body unread or one that is not coming, the connection closed with the answer."""

from __future__ import annotations

from aiohttp import web

from tandem.gateway.errors import HttpError


def error_response(error: HttpError) -> web.Response:
    return web.json_response(error.body(), status=error.status, headers=error.headers())


async def answer_and_close(request: web.Request, response: web.StreamResponse) -> None:
    """`response` written, then the connection closed at once, for a body that stalled or trickled, or
    one announced and refused before it was asked for (`Expect: 100-continue`): aiohttp would otherwise
    linger (its lingering_time: read and drop what is left of the body) on a connection the caller is
    holding open on purpose, or for a body that is not coming. nginx closes a connection whose body timed out
    the same way."""
    response.force_close()  # the head says `Connection: close`: a client must not reuse the connection
    await response.prepare(request)
    await response.write_eof()
    if request.protocol is not None:
        request.protocol.force_close()


def drop_rest(request: web.Request, response: web.StreamResponse) -> None:
    """`response` says `Connection: close`, and what is left of the body is dropped as it comes,
    unparsed: closed by the protocol (`RequestHandler.close`), the connection takes no more bytes to
    its parser, and aiohttp's drain reads what was already parsed,
    then waits out its lingering time (LINGERING_S) while the kernel's bytes are read and dropped, so
    that a caller still sending reads the answer, not a reset."""
    response.force_close()
    if request.protocol is not None:
        request.protocol.close()
