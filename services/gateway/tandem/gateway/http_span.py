"""The gateway's HTTP server span: its name and the attributes of the request, by the stable HTTP
semantic conventions (`http.request.method`, `url.scheme`, `url.path`, `http.route`, `client.address`;
`http.response.status_code` and `error.type` once answered, or cut).

The method is the conventions' own: one of the nine HTTP methods, else `_OTHER` (its original in
`http.request.method_original`, and `HTTP` in the span's name), so a caller's invented method can name
no span; the query is left out (`url.query` may carry what its caller would not have recorded, and the
OpenAI API takes none), and the path is as sent, percent-encoded: decoded, a caller's `%00`, `%0A` or
`%E2%80%AE` put a NUL, a newline or a right-to-left override into whatever reads the span. The address
is the connection's: the gateway trusts no forwarding header.
"""

from __future__ import annotations

from aiohttp import web

HTTP_REQUEST_METHOD = "http.request.method"
HTTP_REQUEST_METHOD_ORIGINAL = "http.request.method_original"
HTTP_ROUTE = "http.route"
HTTP_RESPONSE_STATUS_CODE = "http.response.status_code"
URL_SCHEME = "url.scheme"
URL_PATH = "url.path"
CLIENT_ADDRESS = "client.address"
NETWORK_PROTOCOL_VERSION = "network.protocol.version"
ERROR_TYPE = "error.type"

# A request the gateway ended itself (its shutdown past --grace-s, its --write-timeout-s): one value for
# both, as `error.type` is to be grouped on.
GATEWAY_CUT_ERROR = "tandem.gateway_cut"
# The status sent with the answer's head, kept for a request cut after it: its handler returns nothing.
SENT_STATUS = web.RequestKey("sent_status", int)

# The name of the gateway's route for a path or method no other route serves (its 404 and 405): no route.
UNROUTED = "unrouted"

KNOWN_METHODS = frozenset({"CONNECT", "DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT", "TRACE"})
OTHER_METHOD = "_OTHER"


def route_of(request: web.Request) -> str | None:
    """The route the request matched (`/v1/models/{model}`), None for a path no route matches."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None and resource.name != UNROUTED else None


def span_name(request: web.Request, route: str | None) -> str:
    """`{method} {route}`, the method alone where no route matches (every unknown path had its own
    name, a 7 KB path a 7 KB name)."""
    method = request.method if request.method in KNOWN_METHODS else "HTTP"
    return method if route is None else f"{method} {route}"


def request_attributes(request: web.Request, route: str | None) -> dict[str, str]:
    """What the span knows of a request when it starts."""
    attributes = {
        URL_SCHEME: request.scheme,
        URL_PATH: request.rel_url.raw_path,  # not request.raw_path: that is the target, query and all
        NETWORK_PROTOCOL_VERSION: f"{request.version.major}.{request.version.minor}",
    }
    if request.method in KNOWN_METHODS:
        attributes[HTTP_REQUEST_METHOD] = request.method
    else:
        attributes[HTTP_REQUEST_METHOD] = OTHER_METHOD
        attributes[HTTP_REQUEST_METHOD_ORIGINAL] = request.method
    if route is not None:
        attributes[HTTP_ROUTE] = route
    if request.remote:
        attributes[CLIENT_ADDRESS] = request.remote
    return attributes


def response_attributes(status: int) -> dict[str, str | int]:
    """What the span learns of the answer: a 5xx's `error.type` is its status, as the conventions say."""
    attributes: dict[str, str | int] = {HTTP_RESPONSE_STATUS_CODE: status}
    if status >= 500:
        attributes[ERROR_TYPE] = str(status)
    return attributes


async def note_sent_status(request: web.Request, response: web.StreamResponse) -> None:
    """`on_response_prepare`: the status the caller was sent, before the answer's body."""
    request[SENT_STATUS] = response.status


def cut_attributes(request: web.Request) -> dict[str, str | int]:
    """What the span says of a request the gateway cut: its `error.type`, and the status it had sent
    (the conventions' `http.response.status_code` is there if and only if one was sent)."""
    attributes: dict[str, str | int] = {ERROR_TYPE: GATEWAY_CUT_ERROR}
    if (status := request.get(SENT_STATUS)) is not None:
        attributes[HTTP_RESPONSE_STATUS_CODE] = status
    return attributes


def left_attributes(request: web.Request) -> dict[str, int]:
    """What the span says of a request its caller left: the status it had been sent, if any (no
    `error.type`: its leaving is no failure of the server's)."""
    status = request.get(SENT_STATUS)
    return {} if status is None else {HTTP_RESPONSE_STATUS_CODE: status}
