"""The gateway's HTTP server span: its name and the attributes of the request, by the stable HTTP
semantic conventions (`http.request.method`, `url.scheme`, `url.path`, `http.route`, `client.address`;
`http.response.status_code` and `error.type` once answered).

The method is the conventions' own: one of the nine HTTP methods, else `_OTHER` (its original in
`http.request.method_original`, and `HTTP` in the span's name), so a caller's invented method can name
no span; the query is left out (`url.query` may carry what its caller would not have recorded, and the
OpenAI API takes none). The address is the connection's: the gateway trusts no forwarding header.
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

KNOWN_METHODS = frozenset({"CONNECT", "DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT", "TRACE"})
OTHER_METHOD = "_OTHER"


def route_of(request: web.Request) -> str | None:
    """The route the request matched (`/v1/models/{model}`), None for a path no route matches."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else None


def span_name(request: web.Request, route: str | None) -> str:
    """`{method} {route}`, the method alone where no route matches (every unknown path had its own
    name, a 7 KB path a 7 KB name)."""
    method = request.method if request.method in KNOWN_METHODS else "HTTP"
    return method if route is None else f"{method} {route}"


def request_attributes(request: web.Request, route: str | None) -> dict[str, str]:
    """What the span knows of a request when it starts."""
    attributes = {
        URL_SCHEME: request.scheme,
        URL_PATH: request.path,
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
