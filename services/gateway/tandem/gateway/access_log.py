"""The gateway's access log: a line for each request, in aiohttp's format on its `aiohttp.access`
logger, except a health probe that succeeds and Tandem's own readiness probe.

NOTE: why those probes are quiet. `tandem up --openai-port` and `tandem wait` probe /health every 0.2 s
while they wait (`tandem.readiness.PROBE_INTERVAL_S`: about 125 lines in a 25 s start), and compose and
Kubernetes probe it for as long as the gateway runs, so the requests that matter were lost among them.
uvicorn (vLLM's and SGLang's server) logs every probe and its users filter them out themselves; here a
2xx on the health path is left out at the source. A failing probe (503: the decoder does not serve) is
still logged, as is every other request, whatever its answer, except when Tandem's own readiness
probe (its User-Agent, `tandem.readiness.PROBE_USER_AGENT`) is told 503: `tandem wait` and `tandem up`
ask while the decoder loads, where a 503 is the expected answer, and they say themselves what they were
told (`tandem wait` names the target and its last answer when it gives up). vLLM and TGI open their
port only once the model has loaded, so their probes meet a refused connection then, which logs nothing.
"""

from __future__ import annotations

from collections.abc import Iterable

from aiohttp.web_log import AccessLogger
from aiohttp.web_request import BaseRequest
from aiohttp.web_response import StreamResponse

from tandem.gateway.app import HEALTH_PATH
from tandem.gateway.log_text import printable
from tandem.readiness import PROBE_USER_AGENT


def is_quiet(request: BaseRequest, response: StreamResponse) -> bool:
    """Whether the request is a health probe (GET or HEAD; any query string) that succeeded, or
    Tandem's readiness probe told 503 (the decoder does not serve yet). Anything else on the path (a
    POST, a 404 or 405, a 500) is logged whoever sends it: the User-Agent is the caller's to choose."""
    if request.path != HEALTH_PATH or request.method not in ("GET", "HEAD"):
        return False
    if 200 <= response.status < 300:
        return True
    return response.status == 503 and request.headers.get("User-Agent") == PROBE_USER_AGENT


class AccessLog(AccessLogger):
    """aiohttp's access logger (`web.AppRunner(access_log_class=AccessLog)`), less the quiet probes, each
    value a caller chose (its request line, its Referer and User-Agent) escaped (`log_text.printable`):
    a User-Agent holding `"` forged the fields after it, a UTF-8 U+0085 or U+202E in it broke or
    reversed the line."""

    def log(self, request: BaseRequest, response: StreamResponse, time: float) -> None:
        if not is_quiet(request, response):
            super().log(request, response, time)

    def _format_line(
        self, request: BaseRequest, response: StreamResponse, time: float
    ) -> Iterable[tuple[str | tuple[str, str], str]]:
        # The one method every value passes through, the line's and the record's `extra` alike: aiohttp
        # looks its formatters up on AccessLogger itself, so a subclass's `_format_r` is never called.
        line = super()._format_line(request, response, time)
        return [
            (key, printable(request_line(request) if key == "first_request_line" else value))
            if isinstance(value, str)
            else (key, value)
            for key, value in line
        ]


def request_line(request: BaseRequest) -> str:
    """The request line with its target as sent: aiohttp's has the target's path and query, empty for a
    CONNECT (`CONNECT  HTTP/1.1`, its target an authority) and for an absolute-form target with no path
    (`GET http://x`), and its escapes decoded (`/v1/models/a%2Fb` read `/v1/models/a/b`)."""
    version = request.version  # `raw_path` is the target as the request line has it, a whole URL too
    return f"{request.method} {request.raw_path} HTTP/{version.major}.{version.minor}"
