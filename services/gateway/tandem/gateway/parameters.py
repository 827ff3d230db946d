"""The parameters a chat and a completion body share beside their prompt: sampling, stopping, `n`
within the bound on a request's choices, structured output, and the stream's options."""

from __future__ import annotations

import sys
from typing import Any

from tandem.client.errors import InvalidArgument
from tandem.client.pb.tandem.v1 import decoder_pb2
from tandem.gateway.body_limits import MAX_LOGIT_BIAS, MAX_STOP, MAX_STOP_TOKEN_IDS, BodyLimits, at_most
from tandem.gateway.calls import GenerateCall, ImagePart
from tandem.gateway.errors import BodyNames
from tandem.gateway.fields import INT64_MIN, UINT32, UINT64, field, float32, number, shown, uint
from tandem.gateway.prompt_logprobs import prompt_logprobs
from tandem.gateway.structured import structured_output


def common_parameters(
    body: dict[str, Any],
    request: decoder_pb2.GenerateRequest,
    limits: BodyLimits,
    num_prompts: int,
    max_tokens: tuple[str, ...],
    default_max_tokens: int | None,
) -> tuple[BodyNames, int]:
    """The sampling and stopping parameters both endpoints share, and `n` against the bound on a
    request's choices (`num_prompts` x n); returns the body's names for the fields errors may name,
    and n. `default_max_tokens`: the endpoint's max_tokens where the body sets none, None for as many
    as the context leaves."""
    request.model = field(body, "model", str) or ""
    n = field(body, "n", int)
    n = 1 if n is None else n
    _bound_choices(num_prompts, n, limits.max_choices)
    best_of = uint(body, "best_of", 1)
    if best_of is not None and best_of < n:
        raise InvalidArgument("best_of", f"must be at least n ({n}), got {shown(best_of)}")
    if best_of is not None and best_of != n:
        # Ranking candidates by their likelihood is gone from vLLM V1 as well; best_of = n is plain n.
        raise InvalidArgument("best_of", f"only best_of equal to n ({n}) is supported, got {shown(best_of)}")
    # Each spelling is checked, the first one sent is used (vLLM's `max_completion_tokens or
    # max_tokens`): a bad max_tokens beside a max_completion_tokens was never read, a 200.
    given = [(name, value) for name in max_tokens if (value := uint(body, name, 1)) is not None]
    max_tokens_field = given[0][0] if given else max_tokens[-1]
    if given:
        request.stopping.max_new_tokens = given[0][1]
    else:
        # OpenAI's and vLLM's defaults, not the decoder's 256: a chat runs until it stops or the
        # context is full, a completion takes 16 tokens, either cut to the room the prompt leaves (vLLM's
        # max_model_len - prompt). A max_tokens the caller sent still has to fit, as in vLLM.
        request.stopping.cap_to_context = True
        if default_max_tokens is not None:
            request.stopping.max_new_tokens = default_max_tokens
    field(body, "user", str)  # OpenAI's end-user ID: read by no one here, but of its type
    for name, target in (
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("frequency_penalty", "frequency_penalty"),
        ("presence_penalty", "presence_penalty"),
    ):
        value = number(body, name)
        if value is not None:
            setattr(request.sampling, target, value)
    # vLLM's extra parameters (the openai SDK sends them with extra_body), where Tandem has them.
    top_k = field(body, "top_k", int)
    if top_k is not None:
        if not -1 <= top_k <= UINT32:
            raise InvalidArgument(
                "top_k", f"must be -1 (off, as vLLM spells it) or in [0, {UINT32}], got {shown(top_k)}"
            )
        request.sampling.top_k = max(top_k, 0)
    for name in ("min_p", "repetition_penalty"):
        value = number(body, name)
        if value is not None:
            setattr(request.sampling, name, value)
    if field(body, "ignore_eos", bool):
        request.stopping.ignore_eos = True
    min_tokens = uint(body, "min_tokens")
    if min_tokens is not None:
        request.stopping.min_new_tokens = min_tokens
    seed = field(body, "seed", int)
    if seed is not None:
        # vLLM takes an int64 seed, the decoder a uint64: a negative one is its two's complement (-1
        # is 2**64 - 1, one seed), so every seed either takes is a seed here, each sampled alike.
        if not INT64_MIN <= seed <= UINT64:
            raise InvalidArgument(
                "seed",
                f"must be in [{INT64_MIN}, {UINT64}] (int64's negatives as their two's complement), "
                f"got {shown(seed)}",
            )
        request.sampling.seed = seed % 2**64
    stop = body.get("stop")
    is_stop_string = isinstance(stop, str)
    if is_stop_string:
        stop = [stop]
    if stop is not None:
        if not isinstance(stop, list) or len(stop) > MAX_STOP or not all(isinstance(s, str) for s in stop):
            raise InvalidArgument("stop", f"must be a string or a list of at most {MAX_STOP} strings")
        request.stopping.stop_sequences.extend(stop)
    _stopping_extras(body, request.stopping)
    logit_bias = field(body, "logit_bias", dict) or {}
    at_most("logit_bias", len(logit_bias), MAX_LOGIT_BIAS, "entries")
    keys: dict[int, str] = {}  # token ID -> the key that named it
    for key, value in logit_bias.items():
        # The length first: int() of over 4,300 digits raises (Python's bound on a str's digits), and
        # UINT32 has 10. Its zeros padding a key are no digits of the ID, so int() reads the key without
        # them too: of the whole key it raised on 5,000 zeros before a 5 (a 500). A JSON integer has no
        # bound, and one past the largest float overflows math.isfinite and float(): compared as it
        # is, it and NaN and the infinities are all refused.
        digits = key.lstrip("0") or "0"
        is_id = key.isascii() and key.isdigit() and len(digits) <= len(str(UINT32)) and int(digits) <= UINT32
        is_number = isinstance(value, int | float) and not isinstance(value, bool)
        if not is_id or not is_number or not abs(value) <= sys.float_info.max:
            raise InvalidArgument(
                "logit_bias", f"maps token IDs to finite numbers; got {shown(key)}: {shown(value)}"
            )
        # "05" and "5" are one token: the later would silently win, so which bias was meant is asked.
        token_id = int(digits)
        if (earlier := keys.setdefault(token_id, key)) != key:
            raise InvalidArgument(
                "logit_bias", f"keys {shown(earlier)} and {shown(key)} both name token {token_id}"
            )
        request.sampling.logit_bias[token_id] = float32(float(value), "logit_bias", value)
    prompt_logprobs(body, request)
    structured_field = structured_output(body, request)
    # vLLM's extras the decoder has no counterpart of: refused, not answered otherwise (a sample where
    # a beam search was asked, tokens the caller ruled out). Each is of its type first: read by its
    # truthiness, a wrong one that is falsy (`use_beam_search: ""`, `tools: 0`) passed as not asked.
    for name, kind in (("use_beam_search", bool), ("bad_words", list)):
        if field(body, name, kind):
            raise InvalidArgument(name, "is not supported")
    if field(body, "allowed_token_ids", list) is not None:  # [] allows no token (vLLM refuses it too)
        raise InvalidArgument("allowed_token_ids", "is not supported")
    _tokenizing(body)
    for name in ("tools", "functions"):  # [] asks for no tool: clients send it on plain turns
        if field(body, name, list):
            raise InvalidArgument(name, "tool calling is not supported")
    # With no tools, "none" and "auto" ask for text, which is what comes; "required" or a named
    # function asks for a call the answer would not hold (OpenAI and vLLM refuse a tool_choice
    # without tools, and Codex sends "auto" on plain turns, so that one passes).
    for name in ("tool_choice", "function_call"):
        if field(body, name, (str, dict)) not in (None, "none", "auto"):
            raise InvalidArgument(
                name, f"tool calling is not supported: only 'none' or 'auto', got {shown(body[name])}"
            )
    return BodyNames(structured_field, max_tokens_field, is_stop_string=is_stop_string), n


# vLLM's extras on how text becomes tokens and back, each of which the decoder does one way: that
# way (vLLM's default, or what the decoder does where vLLM's default differs) and null pass; any other
# value is refused, not answered as if it were honoured.
_ONE_WAY = (
    ("skip_special_tokens", True, "the answer's text leaves special tokens out"),
    ("spaces_between_special_tokens", True, "special tokens are left out of the text"),
    ("return_tokens_as_token_ids", False, "logprobs spell a token by its text where it has one"),
    # vLLM's default for completions is true; the decoder tokenizes a prompt without special tokens,
    # so that is what false says and true would not be done.
    ("add_special_tokens", False, "the prompt is tokenized as sent, with no special tokens added"),
)


def _tokenizing(body: dict[str, Any]) -> None:
    """vLLM's tokenizing extras the decoder does one way (`_ONE_WAY`), truncate_prompt_tokens, and
    parallel_tool_calls (OpenAI's bool: with tool calling refused, no call is made either way)."""
    for name, done, how in _ONE_WAY:
        value = field(body, name, bool)
        if value is not None and value is not done:
            raise InvalidArgument(name, f"is not supported as {str(value).lower()}: {how}")
    if field(body, "truncate_prompt_tokens", int) is not None:
        raise InvalidArgument(
            "truncate_prompt_tokens", "is not supported: a prompt longer than the context is refused"
        )
    field(body, "parallel_tool_calls", bool)


def _stopping_extras(body: dict[str, Any], stopping: decoder_pb2.StoppingCriteria) -> None:
    """vLLM's `stop_token_ids` and `include_stop_str_in_output`, which the decoder has: dropped, a
    generation went on past a stop token the caller named."""
    stop_ids = field(body, "stop_token_ids", list) or []
    at_most("stop_token_ids", len(stop_ids), MAX_STOP_TOKEN_IDS, "token IDs")
    for i, token_id in enumerate(stop_ids):
        if not isinstance(token_id, int) or isinstance(token_id, bool) or not 0 <= token_id <= UINT32:
            raise InvalidArgument(
                f"stop_token_ids[{i}]", f"must be a token ID in [0, {UINT32}], got {shown(token_id)}"
            )
    stopping.stop_token_ids.extend(stop_ids)
    if field(body, "include_stop_str_in_output", bool):
        stopping.include_stop_in_output = True


def _bound_choices(num_prompts: int, n: int, max_choices: int) -> None:
    """A request's choices, its prompts x n, each a Generate stream, within `max_choices`; the error
    names `n`, or `prompt` where it is the batch that passes the limit."""
    if not 1 <= n <= max_choices:  # the bound is --max-choices, not the proto's uint32
        raise InvalidArgument(
            "n",
            f"must be in [1, {max_choices}] (the gateway's --max-choices, never above its "
            f"--max-streams-per-caller), got {shown(n)}",
        )
    if num_prompts * n <= max_choices:
        return
    bound = (
        f"the limit of {max_choices} choices a request (prompts x n, each a Generate stream: the "
        "gateway's --max-choices, never above its --max-streams-per-caller)"
    )
    asked = (
        f"{num_prompts} prompts" if n == 1 else f"{num_prompts} prompts x n {n} = {num_prompts * n} choices"
    )
    raise InvalidArgument("prompt", f"{asked} exceed {bound}")


def generate_call(
    body: dict[str, Any],
    prompts: tuple[decoder_pb2.GenerateRequest, ...],
    n: int,
    is_batch: bool,
    images: tuple[ImagePart, ...],
    names: BodyNames,
) -> GenerateCall:
    """The call of `prompts`, with what the answer needs of the body: its stream options among it."""
    is_stream = field(body, "stream", bool) is True
    options = field(body, "stream_options", dict)
    if options and not is_stream:  # vLLM's rule: the options of a stream only (an empty {} passes)
        raise InvalidArgument("stream_options", "needs stream: true")
    include_usage = field(options or {}, "include_usage", bool, "stream_options.") is True
    return GenerateCall(
        requests=prompts,
        n=n,
        is_batch=is_batch,
        images=images,
        model=prompts[0].model,
        is_stream=is_stream,
        include_usage=include_usage,
        names=names,
    )
