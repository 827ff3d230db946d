"""gRPC statuses and the gateway's own refusals -> OpenAI's error shape with the HTTP status clients
expect: `{"error": {"message", "type", "param", "code"}}`. The field a status names (its BadRequest
violation) becomes `param`, in the request body's terms (`chat.messages[0]` -> `messages[0]`), and a
RESOURCE_EXHAUSTED's RetryInfo becomes `Retry-After`."""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from tandem.client.errors import InvalidArgument
from tandem.client.grpc_failures import GrpcsOwnWarnings, is_grpcs_own
from tandem.client.over_cap import OverCap, over_cap
from tandem.client.status_details import status_details
from tandem.gateway.log_text import printable

log = logging.getLogger(__name__)

# gRPC code -> (HTTP status, OpenAI error type)
STATUSES: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}
# What a grpc.aio call cancelled by its own side reads: the gateway's cancel of a caller that left. Any
# other CANCELLED is the service's doing, above all gRPC core's drop of a call past its queue of calls
# not yet taken up, which reads "CANCELLED" (RELIABILITY.md): no caller cancelled, so no 499.
LOCAL_CANCEL = "Locally cancelled by application!"
# A service's RetryInfo past this (or not above 0) is no advice to pass on: it is taken as none, and a 429
# or 503 says the 1 s it says without one, as the decoder bounds an encoder's. It was passed on as it
# came: an encoder's 2**63 - 1 s made `Retry-After: 9223372036854775808`.
MAX_RETRY_AFTER_S = 60.0
# gRPC's own failures said to the HTTP caller, naming the service; what gRPC said is logged (WARNING).
# Passed on, they quoted gRPC's internals: "failed to connect to all addresses; last error: UNKNOWN:
# ipv4:10.0.0.7:50052: connection attempt timed out before receiving SETTINGS frame" named the
# decoder's address and port to every caller.
UNREACHABLE = {
    grpc.StatusCode.UNAVAILABLE: "the {service} could not be reached (no connection, or it was lost); retry",
    grpc.StatusCode.DEADLINE_EXCEEDED: "the {service} did not answer in time; retry",
}

# Module-wide, as `log` is: `from_grpc` is called on every path that answers a failed call, with no
# object of the gateway's at hand to hold it.
_grpcs_own_warnings = GrpcsOwnWarnings(log)


@dataclass(frozen=True)
class HttpError:
    status: int
    type: str
    message: str
    param: str | None = None
    retry_after_s: float | None = None
    code: str | None = None  # OpenAI's code where it has its own (model_not_found); else from the type
    # What else the answer's head says (a 415's Accept-Encoding).
    more_headers: tuple[tuple[str, str], ...] = ()

    def body(self) -> dict:
        code = self.code or (self.type if self.status != 429 else "rate_limit_exceeded")
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": code}}

    def for_input(self, input_field: Callable[[int, str], str], i: int) -> HttpError:
        """This error of the encoder's call for an embeddings body's input i, its field (the encoder's
        `text`, `token_ids.ids[j]`, `image`) as the body names it, in the message too."""
        if self.param is None:
            return self
        param = input_field(i, self.param)
        message = (
            param + self.message[len(self.param) :] if self.message.startswith(self.param) else self.message
        )
        return dataclasses.replace(self, param=param, message=message)

    def for_prompt(self, i: int) -> HttpError:
        """This error of the Generate call for a batch's prompt i, its prompt named as the body names
        it: the decoder's `prompt` (a prompt too long), `prompt[0]` (its one segment) or
        `prompt[0].token_ids.ids[j]` is `prompt[i]` or `prompt[i][j]`, in the message too. An error on
        another field (max_tokens) keeps it and says which prompt it was."""
        if self.param is None or PROMPT.match(self.param) is None:
            return dataclasses.replace(self, message=f"{self.message} (prompt[{i}] of the batch)")
        param = PROMPT.sub(f"prompt[{i}]", self.param, count=1)
        message = (
            param + self.message[len(self.param) :] if self.message.startswith(self.param) else self.message
        )
        return dataclasses.replace(self, param=param, message=message)

    def headers(self) -> dict[str, str]:
        headers = dict(self.more_headers)
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after_s)))
        return headers


class Refused(Exception):
    """The gateway's own refusal of a request (a body too large or too slow, the gateway too busy),
    answered as `error`; with `close`, the connection is closed once the answer is written (a body that
    stalled: what is left of it is not worth waiting for)."""

    def __init__(self, error: HttpError, close: bool = False) -> None:
        super().__init__(error.message)
        self.error = error
        self.close = close


class PromptShape(enum.Enum):
    """How a completion body gave its one prompt, the decoder's segments of it: which of the body's
    fields the decoder's `prompt[j]...` paths are."""

    TEXT = "text"  # a string: the one segment is the body's `prompt`
    TOKEN_IDS = "token_ids"  # a list of IDs: the one segment is `prompt`, its ID k `prompt[k]`
    SEGMENTS = "segments"  # a list of parts: segment j is `prompt[j]`, its ID k `prompt[j][k]`


@dataclass(frozen=True)
class BodyNames:
    """How one body names the fields a service's error may name, where the body had a choice."""

    structured: str | None = None  # the field that asked for structured output (guided_regex, ...)
    max_tokens: str = "max_tokens"  # or max_completion_tokens: the one the caller sent
    # A completion's one prompt; None for a chat, and for a batch, whose prompt i each call names
    # (`HttpError.for_prompt`).
    prompt: PromptShape | None = None
    # A chat's image_url parts, (message, part): the decoder's image part there is the body's
    # `image_url` (the encoder's rows of its file); any other image part is a tandem_image_embeddings
    # part, whose rows are the body's `embeddings`.
    image_urls: frozenset[tuple[int, int]] = frozenset()
    # `stop` sent as one string, the decoder's stop_sequences[0]: named `stop`, not an element it lacks.
    is_stop_string: bool = False
    # What else of the body the template read (chat_template_kwargs, documents): a template failure may
    # be theirs as much as the messages'.
    template_extras: tuple[str, ...] = ()
    # The decoder's chat.template_kwargs.documents is the body's `documents` (no kwarg of that name).
    documents: bool = False


# A batch prompt's Generate call has one segment: the decoder's paths into it, up to what follows the
# body's `prompt[i]` (`[j]` of its token IDs).
PROMPT = re.compile(
    r"^prompt(?:\[0\]\.token_ids\.ids(?=\[)|\[0\](?:\.token_ids(?:\.ids)?|\.text)?(?![\w\[])|(?![\w\[]))"
)
# Segment j of a prompt given as a list of parts, up to what follows the body's `prompt[j]` (`[k]` of
# its token IDs); an embeddings part's own fields (`prompt[j].embeddings.shape`) are the body's already.
SEGMENT = re.compile(r"^prompt(\[\d+\])(?:\.token_ids\.ids(?=\[)|(?:\.token_ids(?:\.ids)?|\.text)(?![\w\[]))")


def from_invalid(error: InvalidArgument) -> HttpError:
    return HttpError(400, "invalid_request_error", str(error), error.field)


def from_grpc(
    error: grpc.aio.AioRpcError, names: BodyNames = BodyNames(), service: str = "decoder"
) -> HttpError:
    """`error` of a call to `service` ("decoder", "encoder") in OpenAI's shape, its fields named as the
    body named them (`names`: the field that asked for structured output, which the decoder's
    `structured.*` paths are named after, and the caller's spelling of max_tokens). gRPC's own
    UNAVAILABLE or DEADLINE_EXCEEDED (`is_grpcs_own`) is said in the gateway's words, naming `service`."""
    status, kind = STATUSES.get(error.code(), (500, "server_error"))
    if is_grpcs_own(error):
        said = printable(error.details() or "")
        _grpcs_own_warnings.warn(
            service, error.code(), f"a call to the {service} failed: {error.code().name}: {said}"
        )
        message = UNREACHABLE[error.code()].format(service=service)
        return HttpError(status, kind, message, retry_after_s=1.0 if status == 503 else None)
    details = status_details(error)
    param = body_field(details.field_violations[0][0], names) if details.field_violations else None
    retry_after = details.retry_delay_s
    if retry_after is not None and not 0 < retry_after <= MAX_RETRY_AFTER_S:
        retry_after = None
    message = error.details() or error.code().name
    if (over := over_cap(error)) is not None:  # the transport's size limit: not retryable
        return _over_message_limit(over)
    if error.code() == grpc.StatusCode.CANCELLED and message != LOCAL_CANCEL:
        return HttpError(503, "service_unavailable", _cancelled_by_service(message), retry_after_s=1.0)
    if status in (429, 503) and retry_after is None:  # busy, or a service down: both worth a retry
        retry_after = 1.0
    if param == "chat":  # the rendered prompt as a whole (its length): the body's messages
        param, message = "messages", _renamed(message, "chat:", "messages:")
    if param == MODEL_TEMPLATE and names.template_extras:  # which of them, only the template's text tells
        param = None
        *some, last = ("the messages", *names.template_extras)
        read = f"{', '.join(some)} or {last}"
        message = _renamed(message, "chat.chat_template:", f"the model's chat template failed on {read}:")
    if param == MODEL_TEMPLATE:  # it failed on the messages (roles that must alternate, a part dropped)
        param = "messages"
        message = _renamed(
            message, "chat.chat_template:", "messages: the model's chat template failed on them:"
        )
    if param == "adapter":  # the body's model other than the base model, sent as the adapter to run
        param, message = "model", "model" + message.removeprefix("adapter")
    code = None
    if error.code() == grpc.StatusCode.NOT_FOUND and message.startswith(("adapter ", "model ")):
        # The body's model names the adapter (the gateway sends it as one), or a model the service
        # does not serve (the encoder's check of an embeddings body's): OpenAI's unknown model, named
        # as the caller wrote it, not as the decoder's field it never sent.
        # OpenAI's type, as GET /v1/models/{model} answers: one 404 form whichever endpoint.
        param, code, message = "model", "model_not_found", _renamed(message, "adapter ", "model ")
        kind = "invalid_request_error"
    return HttpError(status, kind, body_field(message, names), param, retry_after, code)


def _cancelled_by_service(message: str) -> str:
    if message == grpc.StatusCode.CANCELLED.name:  # gRPC core's drop: no status of the service's own
        return (
            "the service was overloaded: it dropped the call before taking it up (more calls at once "
            "than it queues); retry later"
        )
    return f"the service cancelled the call ({message}); retry later"


def _over_message_limit(over: OverCap) -> HttpError:
    """gRPC's refusal of a Generate call's message over a --max-message-bytes (an encoder's Embed call is
    named by `image_bytes.over_cap`), in the body's terms: a request over a cap is the body's (no single
    field made it), a 413; a reply over one is what the body asked for, which only asking for less or a
    larger cap mends, a 500 naming the side whose cap it was. A reply over the gateway's was the request
    over the decoder's, named 413 "send a smaller body" of a 3.7 KB body that asked for prompt_logprobs."""
    side = "gateway" if over.is_ours else "decoder"
    if not over.is_reply:
        # Over the decoder's is over the lower of the two: the gateway's own check let it by.
        mend = "" if side == "decoder" else ", or start the gateway with a larger --max-message-bytes"
        below = " (below the gateway's)" if side == "decoder" else ""
        message = (
            f"the request body is {over.num_bytes} bytes as a Generate call, over the {side}'s "
            f"--max-message-bytes of {over.max_bytes}{below}; send a smaller body{mend}"
        )
        return HttpError(413, "invalid_request_error", message)
    # Over the gateway's, the decoder sent it: the gateway's is the lower (both cap what they send).
    limit = (
        f"the gateway's --max-message-bytes of {over.max_bytes} (below the decoder's)"
        if over.is_ours
        else f"the decoder's own --max-message-bytes of {over.max_bytes}"
    )
    message = (
        f"the decoder's reply is {over.num_bytes} bytes, over {limit}: ask for less (fewer prompt_logprobs "
        f"or logprobs, a shorter prompt or fewer tokens), or start the {side} with a larger "
        "--max-message-bytes"
    )
    # The same body asked again gets the same reply: the openai SDKs retry a 5xx unless told not to.
    return HttpError(500, "server_error", message, more_headers=(("x-should-retry", "false"),))


def _renamed(message: str, service: str, body: str) -> str:
    """`message` with its leading `service` (the field it is about) spelled as the body spells it."""
    return body + message[len(service) :] if message.startswith(service) else message


MODEL_TEMPLATE = "the model's chat template"
# A service's field path -> the body's (first matching prefix).
BODY_FIELDS = (
    ("chat.messages", "messages"),
    # No HTTP body carries a template (chat_request refuses one): the decoder's is the model's own.
    ("chat.chat_template", MODEL_TEMPLATE),
    ("chat.template_kwargs", "chat_template_kwargs"),
    ("chat.add_generation_prompt", "add_generation_prompt"),
    ("stopping.stop_token_ids", "stop_token_ids"),
    ("stopping.include_stop_in_output", "include_stop_str_in_output"),
    ("stopping.min_new_tokens", "min_tokens"),
    ("stopping.stop_sequences", "stop"),
    ("stopping.ignore_eos", "ignore_eos"),
    ("output.top_logprobs", "top_logprobs"),
    ("output.prompt_logprobs", "prompt_logprobs"),  # its bounds, and the caller's budget of entries (429)
    ("output.logprobs", "logprobs"),
    ("sampling.", ""),
)
# The decoder's `structured` field and its kinds, as `response_format` spells them.
RESPONSE_FORMAT_FIELDS = {".json_schema": "response_format.json_schema.schema", "": "response_format"}
# `structured.<kind>`, or `structured` as a whole field (not the word in "structured output").
STRUCTURED = re.compile(r"\bstructured(\.[a-z_]+|(?=:|$))")
# The decoder's limit on new tokens, as a path or as a bound a message states (`max_new_tokens=4`).
MAX_NEW_TOKENS = re.compile(r"\b(?:stopping\.)?max_new_tokens\b")
# The decoder's kwarg holding a body's `documents` (not a kwarg `documents_x`).
DOCUMENTS = re.compile(r"\bchat\.template_kwargs\.documents(?![\w])")
# The body's stop[0], once BODY_FIELDS has named it (not stop_token_ids[0]).
STOP_STRING = re.compile(r"(?<![\w.])stop\[0\]")
# A chat part's image rows (`messages[i].content[j].image`, and what follows: `.shape`), body-named.
IMAGE_PART = re.compile(r"\bmessages\[(\d+)\]\.content\[(\d+)\]\.image\b((?:\.[a-z_]+|\[\d+\])*)")
# A chat's encoder part and what follows (`.image.data`, `.embeddings.shape`: its file, the rows fetched
# for it), for a decoder that fetches the rows itself. The gateway sends only image_url parts so, and
# none of those fields is the body's: its field is the part's `image_url`, as when the gateway fetches
# the rows (IMAGE_PART). It was `...image_url.image.data`, `...image_url.embeddings.shape`.
ENCODER_PART = re.compile(r"\bmessages\[(\d+)\]\.content\[(\d+)\]\.encoder\b(?:\.[a-z_]+|\[\d+\])*")


def body_field(path: str, names: BodyNames = BodyNames()) -> str:
    """A service's field path (or a message holding one) as the OpenAI body spells it. The decoder's
    `structured.<kind>` is the body field that asked for it: `response_format.json_schema.schema`,
    or vLLM's own (`guided_regex`, `guided_grammar`, `guided_json`, `guided_choice`);
    `stopping.max_new_tokens` is max_tokens or max_completion_tokens, whichever the caller sent; a
    completion's segment `prompt[j]` is the body's prompt as it gave it (`names.prompt`):
    `prompt[0].token_ids.ids[k]` is `prompt[k]` of a list of IDs and `prompt[j][k]` of a list of parts."""
    path = MAX_NEW_TOKENS.sub(names.max_tokens, path)
    if names.prompt is PromptShape.SEGMENTS:
        path = SEGMENT.sub(r"prompt\1", path, count=1)
    elif names.prompt is not None:  # the prompt is its one segment
        path = PROMPT.sub("prompt", path, count=1)
    if names.documents:
        path = DOCUMENTS.sub("documents", path)
    for service, body in BODY_FIELDS:
        path = path.replace(service, body)
    if names.is_stop_string:
        path = STOP_STRING.sub("stop", path)
    path = IMAGE_PART.sub(lambda m: _image_part(m, names.image_urls), path)
    path = ENCODER_PART.sub(r"messages[\1].content[\2].image_url", path)
    structured_field = names.structured
    if structured_field is not None and structured_field != "response_format":
        return STRUCTURED.sub(structured_field, path)
    return STRUCTURED.sub(lambda m: RESPONSE_FORMAT_FIELDS.get(m[1] or "", "response_format"), path)


def _image_part(match: re.Match[str], image_urls: frozenset[tuple[int, int]]) -> str:
    """A chat's image part as its body gave it: an image_url part (whose rows, shape and all, are the
    encoder's of its file: the body's field is the URL), or a tandem_image_embeddings part's rows."""
    message, part, rest = match[1], match[2], match[3]
    if (int(message), int(part)) in image_urls:
        return f"messages[{message}].content[{part}].image_url"
    return f"messages[{message}].content[{part}].embeddings{rest}"
