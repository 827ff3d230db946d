"""The services' field paths, in the body's own terms: a structured-output error names the field the
caller used to ask for it."""

from __future__ import annotations

import aiohttp
import grpc
import pytest
from google.protobuf import any_pb2, duration_pb2
from google.protobuf.message import Message
from google.rpc import error_details_pb2, status_pb2

from tandem.client.grpc_failures import GrpcsOwnWarnings
from tandem.gateway import errors
from tandem.gateway.body_limits import BodyLimits
from tandem.gateway.chat_request import chat_request
from tandem.gateway.errors import UNREACHABLE, BodyNames, PromptShape, body_field, from_grpc

from .fake_decoder import fake_decoder
from .live_gateway import live_gateway

LIMITS = BodyLimits.for_chat(4096, 16)


@pytest.mark.parametrize(
    ("path", "structured_field", "expected"),
    [
        ("structured.regex", "guided_regex", "guided_regex"),
        ("structured.grammar: does not compile: x", "guided_grammar", "guided_grammar: does not compile: x"),
        ("structured.json_schema", "guided_json", "guided_json"),
        ("structured.choice", "guided_choice", "guided_choice"),
        ("structured.json_schema", "response_format", "response_format.json_schema.schema"),
        ("structured.json_object", "response_format", "response_format"),
        ("structured", None, "response_format"),
        ("structured output is not available on this server", "guided_regex",
         "structured output is not available on this server"),  # the words, not a field
        ("chat.messages[2].content[0].image", "guided_regex", "messages[2].content[0].embeddings"),
        ("stopping.stop_sequences[0]", None, "stop[0]"),
        ("sampling.top_k", None, "top_k"),
        ("output.prompt_logprobs: the limit is 2520", None, "prompt_logprobs: the limit is 2520"),
        ("output.logprobs", None, "logprobs"),
        ("stopping.stop_token_ids[3]", None, "stop_token_ids[3]"),
        ("stopping.include_stop_in_output", None, "include_stop_str_in_output"),
        ("chat.chat_template: does not compile", None, "the model's chat template: does not compile"),
        ("chat.template_kwargs", None, "chat_template_kwargs"),
        ("chat.template_kwargs.add_generation_prompt: is chat.add_generation_prompt's", None,
         "chat_template_kwargs.add_generation_prompt: is add_generation_prompt's"),
        ("chat.add_generation_prompt", None, "add_generation_prompt"),
    ],
)  # fmt: skip
def test_a_service_path_is_named_as_the_body_names_it(
    path: str, structured_field: str | None, expected: str
) -> None:
    assert body_field(path, BodyNames(structured=structured_field)) == expected


def _rpc_error(code: grpc.StatusCode, message: str, field: str | None = None) -> grpc.aio.AioRpcError:
    """What a service sends: the status, and its field as a BadRequest detail (google.rpc)."""
    bad = error_details_pb2.BadRequest()
    if field is not None:
        bad.field_violations.add(field=field, description=message)
    return _with_detail(code, message, bad)


def _with_detail(code: grpc.StatusCode, message: str, detail: Message) -> grpc.aio.AioRpcError:
    packed = any_pb2.Any()
    packed.Pack(detail)
    status = status_pb2.Status(code=code.value[0], message=message, details=[packed])
    trailing = grpc.aio.Metadata(("grpc-status-details-bin", status.SerializeToString()))
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details=message)


def test_a_chat_too_long_names_the_messages_and_an_unknown_adapter_is_openais_unknown_model() -> None:
    too_long = from_grpc(
        _rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "chat: 9031 positions leave no room", "chat")
    )
    # The message named the decoder's `chat` and the adapter the caller never sent: both are the body's.
    assert (too_long.status, too_long.param) == (400, "messages")
    assert too_long.message == "messages: 9031 positions leave no room"
    unknown = from_grpc(_rpc_error(grpc.StatusCode.NOT_FOUND, "adapter 'gpt-4o' is not loaded: no LoRA"))
    assert unknown.status == 404
    # OpenAI's form, as GET /v1/models/{model} answers it: it was type not_found_error here.
    assert unknown.body()["error"] == {
        "message": "model 'gpt-4o' is not loaded: no LoRA",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }


def test_the_models_template_failing_on_the_messages_names_them_not_a_field_the_gateway_refuses() -> None:
    # No HTTP body carries a template (chat_request refuses one), so the decoder's chat.chat_template is
    # the checkpoint's, failing on the messages (Llama's 'Conversation roles must alternate'): it was
    # named `chat_template`, a field the caller did not and may not send.
    said = "chat.chat_template: the template failed: Conversation roles must alternate user/assistant"
    error = from_grpc(_rpc_error(grpc.StatusCode.INVALID_ARGUMENT, said, "chat.chat_template"))
    assert (error.status, error.param) == (400, "messages")
    assert error.message == (
        "messages: the model's chat template failed on them: the template failed: Conversation roles "
        "must alternate user/assistant"
    )


def test_the_models_template_failing_beside_chat_template_kwargs_blames_neither_alone() -> None:
    # {% if threshold > 3 %} given {"threshold": "a"} fails on the kwarg, the messages fine: it was
    # named `messages` alone. Which of the two the template tripped on only its text can tell.
    said = "chat.chat_template: the template failed: '>' not supported between instances of 'str' and 'int'"
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"threshold": "a"}}
    names = chat_request(body, BodyLimits.for_chat(64, 1)).names
    error = from_grpc(_rpc_error(grpc.StatusCode.INVALID_ARGUMENT, said, "chat.chat_template"), names)
    assert (error.status, error.param) == (400, None)
    assert error.message == (
        "the model's chat template failed on the messages or chat_template_kwargs: the template failed: "
        "'>' not supported between instances of 'str' and 'int'"
    )
    names = chat_request(body | {"documents": [{"text": "x"}]}, BodyLimits.for_chat(64, 1)).names
    error = from_grpc(_rpc_error(grpc.StatusCode.INVALID_ARGUMENT, said, "chat.chat_template"), names)
    assert error.message.startswith(
        "the model's chat template failed on the messages, documents or chat_template_kwargs: "
    )


def test_the_decoders_refusal_of_a_bodys_documents_names_documents() -> None:
    # The body's documents reach the decoder as its kwarg `documents`: its refusals named
    # chat_template_kwargs, a field the caller never sent.
    said = (
        "chat.template_kwargs.documents: 1048577 characters of strings and keys exceed the limit of 1048576"
    )
    limits = BodyLimits.for_chat(64, 1)
    body = {"messages": [{"role": "user", "content": "hi"}], "documents": [{"text": "x"}]}
    for extras, name in (
        ({}, "documents"),
        ({"chat_template_kwargs": {"documents": []}}, "chat_template_kwargs.documents"),
    ):
        names = chat_request(body | extras, limits).names
        rpc = _rpc_error(grpc.StatusCode.INVALID_ARGUMENT, said, "chat.template_kwargs.documents")
        error = from_grpc(rpc, names)
        assert (error.status, error.param, error.message.split(":")[0]) == (400, name, name)


def test_a_service_that_serves_another_model_is_openais_unknown_model() -> None:
    # The encoder's refusal of an embeddings body's model (check_model): it was a 404 with no param
    # and code not_found_error, where a chat's unknown model is model_not_found naming `model`.
    unknown = from_grpc(
        _rpc_error(grpc.StatusCode.NOT_FOUND, "model 'gpt-4o' is not served here (this server serves 'x')")
    )
    error = unknown.body()["error"]
    assert (unknown.status, error["type"], error["param"], error["code"]) == (
        404,
        "invalid_request_error",
        "model",
        "model_not_found",
    )
    assert unknown.message == "model 'gpt-4o' is not served here (this server serves 'x')"


def test_a_bad_adapter_name_is_the_bodys_model_that_named_it() -> None:
    # The gateway sends a model other than the base model as the adapter to run: the caller wrote
    # `model`, and was told about an `adapter` it never sent.
    long = from_grpc(
        _rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "adapter: must be 1 to 256 bytes, got 300", "adapter")
    )
    assert (long.param, long.message) == ("model", "model: must be 1 to 256 bytes, got 300")


def test_a_service_that_is_down_is_a_503_worth_a_retry() -> None:
    down = from_grpc(_rpc_error(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses"))
    assert down.status == 503 and down.headers() == {"Retry-After": "1"}
    assert from_grpc(_rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "x: bad", "x")).headers() == {}


def test_a_call_grpc_dropped_unserved_is_a_503_worth_a_retry_not_the_callers_cancel() -> None:
    # gRPC core ends a call past its queue of calls not yet taken up as CANCELLED "CANCELLED"
    # (RELIABILITY.md): the service was overloaded, the HTTP caller cancelled nothing. It was a 499.
    dropped = from_grpc(_rpc_error(grpc.StatusCode.CANCELLED, "CANCELLED"))
    assert (dropped.status, dropped.type, dropped.headers()) == (
        503,
        "service_unavailable",
        {"Retry-After": "1"},
    )
    assert "overloaded" in dropped.message
    # Cancelled by the server for another reason: no caller's cancel either.
    assert from_grpc(_rpc_error(grpc.StatusCode.CANCELLED, "Cancelled on the server side")).status == 503
    # The gateway's own cancel (the caller left) keeps 499, were it ever answered.
    local = from_grpc(_rpc_error(grpc.StatusCode.CANCELLED, "Locally cancelled by application!"))
    assert (local.status, local.type) == (499, "cancelled")


def test_a_generate_call_over_the_decoders_message_limit_names_the_limit_and_the_body() -> None:
    # The gateway's --max-message-bytes above the decoder's: gRPC's own words were the whole message.
    over = from_grpc(
        _rpc_error(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "SERVER: Received message larger than max (10000064 vs. 4194304)",
        )
    )
    assert (over.status, over.param, over.headers()) == (413, None, {})
    assert over.message == (
        "the request body is 10000064 bytes as a Generate call, over the decoder's --max-message-bytes of "
        "4194304 (below the gateway's); send a smaller body"
    )


@pytest.mark.parametrize(
    ("details", "status", "message"),
    [
        (
            # grpc.aio's own words for it. The gateway's --max-message-bytes below the decoder's, and
            # prompt_logprobs 20: it was 413 "the request body is 364216 bytes ... over the decoder's
            # --max-message-bytes of 16384", of a 3.7 KB body.
            "Stream removed (CLIENT: Received message larger than max (364216 vs. 16384))",
            500,
            "the decoder's reply is 364216 bytes, over the gateway's --max-message-bytes of 16384 (below the "
            "decoder's): ask for less (fewer prompt_logprobs or logprobs, a shorter prompt or fewer tokens), "
            "or start the gateway with a larger --max-message-bytes",
        ),
        (
            "CLIENT: Sent message larger than max (20000 vs. 16384)",
            413,
            "the request body is 20000 bytes as a Generate call, over the gateway's --max-message-bytes of "
            "16384; send a smaller body, or start the gateway with a larger --max-message-bytes",
        ),
        (
            "SERVER: Sent message larger than max (364216 vs. 16384)",
            500,
            "the decoder's reply is 364216 bytes, over the decoder's own --max-message-bytes of 16384: ask "
            "for less (fewer prompt_logprobs or logprobs, a shorter prompt or fewer tokens), or start the "
            "decoder with a larger --max-message-bytes",
        ),
    ],
    ids=["reply-over-the-gateways", "request-over-the-gateways", "reply-over-the-decoders"],
)
def test_a_message_over_a_cap_names_which_message_and_whose_limit(
    details: str, status: int, message: str
) -> None:
    # A request over a cap is the body's (413); a reply over one is the service's limit on what the body
    # asked for (500), which asking for less or a larger limit mends, and no retry.
    over = from_grpc(_rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, details))
    # The openai SDKs retry a 5xx unless `x-should-retry: false`; the same body would fail the same way.
    assert (over.status, over.type, over.param, over.headers()) == (
        (413, "invalid_request_error", None, {})
        if status == 413
        else (500, "server_error", None, {"x-should-retry": "false"})
    )
    assert over.message == message


def test_a_string_stop_is_named_stop_not_its_first_element() -> None:
    # `stop: ""` was named stop[0], an element the body did not have.
    assert body_field("stopping.stop_sequences[0]: must not be empty", BodyNames(is_stop_string=True)) == (
        "stop: must not be empty"
    )
    assert body_field("stopping.stop_token_ids[0]", BodyNames(is_stop_string=True)) == "stop_token_ids[0]"
    names = chat_request({"messages": [{"role": "user", "content": "x"}], "stop": ""}, LIMITS).names
    assert names.is_stop_string
    listed = chat_request({"messages": [{"role": "user", "content": "x"}], "stop": [""]}, LIMITS).names
    assert body_field("stopping.stop_sequences[0]", listed) == "stop[0]"


def _full(seconds: int, nanos: int = 0) -> grpc.aio.AioRpcError:
    """A RESOURCE_EXHAUSTED with a RetryInfo of `seconds` and `nanos`, as a service (or a peer) sends it."""
    delay = duration_pb2.Duration(seconds=seconds, nanos=nanos)
    return _with_detail(
        grpc.StatusCode.RESOURCE_EXHAUSTED, "full", error_details_pb2.RetryInfo(retry_delay=delay)
    )


@pytest.mark.parametrize(
    ("seconds", "nanos", "retry_after"),
    [(3, 500_000_000, "4"), (60, 0, "60"), (61, 0, "1"), (86_400, 0, "1"), (2**63 - 1, 0, "1"), (0, 0, "1"),
     (-5, 0, "1"), (-1, 999_999_999, "1")],
)  # fmt: skip
def test_a_services_retry_delay_past_a_minute_or_not_above_zero_is_a_second(
    seconds: int, nanos: int, retry_after: str
) -> None:
    # It was passed on as it came: an encoder's 2**63 - 1 s made `Retry-After: 9223372036854775808`.
    assert from_grpc(_full(seconds, nanos)).headers() == {"Retry-After": retry_after}


def test_max_new_tokens_is_named_as_the_caller_spelled_it() -> None:
    path = "stopping.max_new_tokens: prompt (9) + max_new_tokens (99) exceeds max_model_len 64"
    assert body_field(path).startswith("max_tokens: ")
    assert body_field(path, BodyNames(max_tokens="max_completion_tokens")).startswith(
        "max_completion_tokens: "
    )


def test_min_tokens_over_max_tokens_states_the_bound_as_the_caller_spelled_it() -> None:
    # It said "must be in [0, max_new_tokens=4]": the decoder's name, which no body field has.
    message = "stopping.min_new_tokens: must be in [0, max_new_tokens=4], got 10"
    error = from_grpc(
        _rpc_error(grpc.StatusCode.INVALID_ARGUMENT, message, "stopping.min_new_tokens"),
        BodyNames(max_tokens="max_completion_tokens"),
    )
    assert (error.param, error.message) == (
        "min_tokens",
        "min_tokens: must be in [0, max_completion_tokens=4], got 10",
    )


def test_a_chats_image_part_is_named_as_the_body_gave_it() -> None:
    # An image_url part's rows are the encoder's of its file: the body's field is the URL. Any other image
    # part was a tandem_image_embeddings part, whose rows are its `embeddings`. Both were `.image`.
    content = [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
        {
            "type": "tandem_image_embeddings",
            "embeddings": {"dtype": "float32", "shape": [1, 2], "data": "AAAAAAAAAAA="},
        },
    ]
    names = chat_request({"messages": [{"role": "user", "content": content}]}, LIMITS).names
    refused = "chat.messages[0].content[0].image: this model takes no images"
    assert body_field(refused, names) == "messages[0].content[0].image_url: this model takes no images"
    shape = "chat.messages[0].content[1].image.shape: expected [n >= 1, 64], got [1, 2]"
    assert (
        body_field(shape, names)
        == "messages[0].content[1].embeddings.shape: expected [n >= 1, 64], got [1, 2]"
    )


@pytest.mark.parametrize(
    ("field", "description"),
    [
        (".encoder", "the encoder refused it: image.data: cannot be preprocessed"),
        (".encoder.image.data", "is empty"),
        (".encoder.image", "must not be empty"),
        (".encoder.embeddings.shape", "expected [n >= 1, 64], got [1, 2]"),
        (
            ".encoder.data",
            "contains NaN or Inf as sent, in float32 (first at index [0, 0]); values must be finite",
        ),
        (".encoder.shared_embeddings.name", "names a segment this call did not ask for"),
    ],
)
def test_an_encoder_fetching_decoders_error_on_an_image_url_part_names_the_part(
    field: str, description: str
) -> None:
    # A decoder that fetches the encoder's rows itself names the encoder part it was sent and the
    # encoder's fields in it: those were passed on as `messages[0].content[1].image_url.image.data`,
    # no field of the body. As the gateway's own errors on the picture, it is the part's image_url.
    decoder_field = f"chat.messages[0].content[1]{field}"
    error = from_grpc(
        _rpc_error(grpc.StatusCode.INVALID_ARGUMENT, f"{decoder_field}: {description}", decoder_field)
    )
    assert (error.param, error.message) == (
        "messages[0].content[1].image_url",
        f"messages[0].content[1].image_url: {description}",
    )


@pytest.mark.parametrize(
    ("field", "expected"),
    [
        ("prompt", "prompt[2]"),  # the prompt too long
        ("prompt[0]", "prompt[2]"),
        ("prompt[0].text", "prompt[2]"),
        ("prompt[0].token_ids.ids[3]", "prompt[2][3]"),
        ("prompt[0].token_ids", "prompt[2]"),
    ],
)
def test_a_batch_prompts_error_names_it_as_the_body_does(field: str, expected: str) -> None:
    error = from_grpc(_rpc_error(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: bad", field)).for_prompt(2)
    assert (error.param, error.message) == (expected, f"{expected}: bad")


def test_a_batch_prompts_error_on_another_field_keeps_it_and_says_which_prompt() -> None:
    error = from_grpc(_rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "top_k: bad", "sampling.top_k"))
    assert (error.for_prompt(1).param, error.for_prompt(1).message) == (
        "top_k",
        "top_k: bad (prompt[1] of the batch)",
    )


@pytest.mark.parametrize(
    ("shape", "path", "expected"),
    [
        (PromptShape.TOKEN_IDS, "prompt[0].token_ids.ids[3]: token id 5000 outside [0, 1000)",
         "prompt[3]: token id 5000 outside [0, 1000)"),
        (PromptShape.TOKEN_IDS, "prompt[0].token_ids", "prompt"),
        (PromptShape.TOKEN_IDS, "prompt: 9031 positions, no room", "prompt: 9031 positions, no room"),
        (PromptShape.TEXT, "prompt[0].text: must not be empty", "prompt: must not be empty"),
        (PromptShape.TEXT, "prompt[0]", "prompt"),
        (PromptShape.SEGMENTS, "prompt[1].token_ids.ids[2]", "prompt[1][2]"),
        (PromptShape.SEGMENTS, "prompt[12].token_ids.ids", "prompt[12]"),
        (PromptShape.SEGMENTS, "prompt[0].text", "prompt[0]"),
        (PromptShape.SEGMENTS, "prompt[1].embeddings.shape", "prompt[1].embeddings.shape"),  # the body's own
        (PromptShape.SEGMENTS, "prompt", "prompt"),
        (None, "prompt[0].token_ids.ids[3]", "prompt[0].token_ids.ids[3]"),  # a batch's: for_prompt names it
    ],
)  # fmt: skip
def test_a_single_prompts_segment_is_named_as_the_body_gave_the_prompt(
    shape: PromptShape | None, path: str, expected: str
) -> None:
    assert body_field(path, BodyNames(prompt=shape)) == expected


# What gRPC itself says of a call it failed: no status of the service's own, no google.rpc details.
GRPCS_OWN = [
    (
        grpc.StatusCode.UNAVAILABLE,
        "failed to connect to all addresses; last error: UNKNOWN: ipv4:10.0.0.7:50052: connection attempt "
        "timed out before receiving SETTINGS frame",
    ),
    (
        grpc.StatusCode.UNAVAILABLE,
        "connections to all backends failing; last error: UNAVAILABLE: ipv4:10.0.0.7:50052: Delayed close "
        "due to in-progress write (ping timeout)",
    ),
    (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"),
]


RETRY = {"Retry-After": "1"}


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test's failures are logged as if none came before (they are logged once per interval)."""
    monkeypatch.setattr(errors, "_grpcs_own_warnings", GrpcsOwnWarnings(errors.log))


@pytest.mark.parametrize(("code", "said"), GRPCS_OWN)
@pytest.mark.parametrize("service", ["decoder", "encoder"])
def test_grpcs_own_failure_of_a_call_names_the_service_not_its_address_and_is_logged(
    code: grpc.StatusCode, said: str, service: str, caplog: pytest.LogCaptureFixture
) -> None:
    """gRPC's words were passed to HTTP callers whole: the decoder's internal address and port, and
    gRPC's own terms (SETTINGS frame, ping timeout). The caller gets the gateway's words naming the
    service; the operator gets gRPC's in the log."""
    error = grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=said)
    with caplog.at_level("WARNING", logger="tandem.gateway.errors"):
        answer = from_grpc(error, service=service)
    if code == grpc.StatusCode.UNAVAILABLE:
        assert (answer.status, answer.type, answer.headers()) == (503, "service_unavailable", RETRY)
        assert answer.message == f"the {service} could not be reached (no connection, or it was lost); retry"
    else:
        assert (answer.status, answer.type, answer.headers()) == (504, "timeout", {})
        assert answer.message == f"the {service} did not answer in time; retry"
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert service in caplog.text and said in caplog.text


@pytest.mark.parametrize(
    "said",
    [
        "the decoder is loading, draining or has failed; retry later",
        "messages[0].content[1].encoder: the encoder did not answer within 60 s; retry",
    ],
)
def test_a_services_own_unavailable_is_passed_on_as_it_said_it(said: str) -> None:
    """The services' own refusals (google.rpc details beside them) are meant for callers: the decoder
    loading, an encoder part whose encoder did not answer (the decoder's words name no encoder's
    address: that is its log's)."""
    answer = from_grpc(_rpc_error(grpc.StatusCode.UNAVAILABLE, said))
    assert (answer.status, answer.message) == (503, body_field(said))  # the part as the body gave it


async def test_embeddings_with_no_encoder_listening_name_the_encoder_not_its_address() -> None:
    """The gateway's encoder at an address where nothing listens: /v1/embeddings was 503 "failed to
    connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:9: Failed to connect to remote
    host: Connection refused"."""
    async with (
        fake_decoder() as (_, address),
        live_gateway(address) as url,
        aiohttp.ClientSession() as http,
        http.post(url + "/embeddings", json={"model": "m", "input": "hi"}) as response,
    ):
        body = await response.json()
    assert (response.status, response.headers["Retry-After"]) == (503, "1")
    assert body["error"]["message"] == UNREACHABLE[grpc.StatusCode.UNAVAILABLE].format(service="encoder")


def test_grpcs_own_failures_of_one_service_are_logged_once_per_interval_for_each_service_and_code(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A stopped decoder fails every call: each was a WARNING line of its own, the same words. Now one
    per interval for each service and code (`grpc_failures.GrpcsOwnWarnings`, whose own tests say
    the interval)."""
    down, said = GRPCS_OWN[0]
    error = grpc.aio.AioRpcError(down, grpc.aio.Metadata(), grpc.aio.Metadata(), details=said)
    late = grpc.aio.AioRpcError(
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(),
        details="Deadline Exceeded",
    )
    with caplog.at_level("WARNING", logger="tandem.gateway.errors"):
        for _ in range(5):
            from_grpc(error)
        from_grpc(error, service="encoder")  # another service: its own line
        from_grpc(late)  # another code: its own line
    assert [r.getMessage() for r in caplog.records] == [
        f"a call to the decoder failed: UNAVAILABLE: {said}",
        f"a call to the encoder failed: UNAVAILABLE: {said}",
        "a call to the decoder failed: DEADLINE_EXCEEDED: Deadline Exceeded",
    ]
