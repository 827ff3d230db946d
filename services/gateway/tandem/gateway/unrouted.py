"""The requests no route serves, answered by a route of their own (`Unrouted`, registered last) so that
their `Expect` is the gateway's to answer too (`Gateway.app`): 404 for a path no route serves, 405 for a
method its route does not, and a CONNECT 405 and closed."""

from __future__ import annotations

from aiohttp import hdrs, web
from aiohttp.abc import AbstractMatchInfo
from aiohttp.web_urldispatcher import MatchInfoError

from tandem.gateway.errors import HttpError
from tandem.gateway.http_span import UNROUTED
from tandem.gateway.refusals import drop_rest, error_response


class Unrouted(web.DynamicResource):
    """Every request target, `*` (`OPTIONS *`) too, which no pattern of aiohttp's matches: each starts with
    "/", and `OPTIONS *` met aiohttp's own expect handler (`Gateway.app`)."""

    def _match(self, path: str) -> dict[str, str] | None:
        return {"path": path}

    def take_unmatched(self, router: web.UrlDispatcher) -> None:
        """Every request `router` matches no route of comes here too. aiohttp tries routes only while a
        path is left to walk, so a target with an empty path, absolute-form with none (`GET http://x`,
        any method) and every CONNECT (its target an authority), reached no route, this one neither: it
        met aiohttp's expect handler, which answered `Expect: foo` 417 and kept the connection (what came
        as its body answered as a request, a token's or not), and sent `100 Continue` before a 401."""
        resolve = router.resolve

        async def resolve_all(request: web.Request) -> AbstractMatchInfo:
            match_info = await resolve(request)
            if isinstance(match_info, MatchInfoError):
                unrouted, _ = await self.resolve(request)  # its `_match` takes every path, "" too
                return unrouted or match_info
            return match_info

        router.resolve = resolve_all  # type: ignore[method-assign]


async def unrouted(request: web.Request) -> web.Response:
    """A path no route serves (404), or a method its route does not (405): a route of its own, so
    that its `Expect` is the gateway's to answer (`Gateway.app`). A CONNECT is 405 too, and closed."""
    if request.method == hdrs.METH_CONNECT:
        return _connect_refused(request)
    allowed: set[str] = set()
    for resource in request.app.router.resources():
        if resource.name != UNROUTED:
            allowed |= (await resource.resolve(request))[1]
    if allowed:
        raise web.HTTPMethodNotAllowed(request.method, allowed)
    raise web.HTTPNotFound()


def _connect_refused(request: web.Request) -> web.Response:
    """405 to a CONNECT, which asks a proxy for a tunnel (RFC 9110 9.3.6): this server is none. What
    follows its head is the tunnel's, not HTTP (aiohttp reads it as the request's body until the
    connection ends), so it is dropped unparsed and the connection closed (`drop_rest`): kept, the
    bytes after a refused CONNECT were answered as requests."""
    served = {
        route.method
        for resource in request.app.router.resources()
        if resource.name != UNROUTED
        for route in resource
    }
    message = "CONNECT asks a proxy for a tunnel: this server is not one"
    allow = (("Allow", ", ".join(sorted(served))),)
    response = error_response(HttpError(405, "invalid_request_error", message, more_headers=allow))
    drop_rest(request, response)
    return response
