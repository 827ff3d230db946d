"""The gateway's HTTP server span is named and described by the stable HTTP semantic conventions: a
method outside the nine is `_OTHER` (`HTTP` in the name), the query is never recorded, and a 5xx's
`error.type` is its status."""

from __future__ import annotations

from aiohttp.test_utils import make_mocked_request

from tandem.gateway.http_span import request_attributes, response_attributes, span_name


def test_a_request_is_described_by_its_method_scheme_path_route_and_protocol_never_its_query() -> None:
    request = make_mocked_request("POST", "/v1/chat/completions?api-key=secret")
    assert request_attributes(request, "/v1/chat/completions") == {
        "http.request.method": "POST",
        "url.scheme": "http",
        "url.path": "/v1/chat/completions",
        "http.route": "/v1/chat/completions",
        "network.protocol.version": "1.1",
    }
    assert span_name(request, "/v1/chat/completions") == "POST /v1/chat/completions"


def test_the_path_is_recorded_as_sent_percent_encoded_so_no_nul_newline_or_bidi_control_reaches_a_span() -> (
    None
):
    request = make_mocked_request("GET", "/v1/a%0Ab%00c%E2%80%AEevil?api_key=sk-secret")
    assert request_attributes(request, None)["url.path"] == "/v1/a%0Ab%00c%E2%80%AEevil"


def test_an_invented_method_is_other_and_names_no_span() -> None:
    request = make_mocked_request("X" * 7000, "/nowhere")
    attributes = request_attributes(request, None)
    assert attributes["http.request.method"] == "_OTHER"
    assert attributes["http.request.method_original"] == "X" * 7000  # cut to 1024 by the span limits
    assert "http.route" not in attributes
    assert span_name(request, None) == "HTTP"


def test_only_a_5xx_has_an_error_type() -> None:
    assert response_attributes(404) == {"http.response.status_code": 404}
    assert response_attributes(503) == {"http.response.status_code": 503, "error.type": "503"}
