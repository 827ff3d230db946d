"""OpenAI bodies into gRPC requests: any JSON a caller can send is either converted or refused with
InvalidArgument naming the field, never another exception (which would be a 500)."""

from __future__ import annotations

import pytest
from google.protobuf import json_format

from tandem.client.errors import InvalidArgument
from tandem.gateway.body_limits import MAX_IMAGES, BodyLimits
from tandem.gateway.calls import ImagePart
from tandem.gateway.chat_request import chat_request
from tandem.gateway.completion_request import completion_request
from tandem.gateway.embed_request import embed_request
from tandem.gateway.errors import body_field
from tandem.gateway.images import as_encoder_parts

LIMITS = BodyLimits.for_chat(256, 16)
EMBED_LIMITS = BodyLimits.for_embeddings(64)

CHAT = {"model": "", "messages": [{"role": "user", "content": "hi"}]}
ROWS = {"dtype": "float32", "shape": [1, 4], "data": "AAAAAAAAAAAAAAAAAAAAAA=="}
TEXT = {"type": "text", "text": "a"}
URL = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}


def _user(*parts: dict) -> dict:
    return {"messages": [{"role": "user", "content": list(parts)}]}


def _rows(**changes: object) -> dict:
    return {"type": "tandem_embeddings", "embeddings": ROWS | changes}


HOSTILE_CHAT = {
    "top_k -2": ({"top_k": -2}, "top_k"),
    "top_k 2**40": ({"top_k": 2**40}, "top_k"),
    "top_k 1.5": ({"top_k": 1.5}, "top_k"),
    "top_k NaN": ({"top_k": float("nan")}, "top_k"),
    "max_tokens 2**32": ({"max_tokens": 2**32}, "max_tokens"),
    "max_tokens true": ({"max_tokens": True}, "max_tokens"),
    "max_completion_tokens 0": ({"max_completion_tokens": 0}, "max_completion_tokens"),
    "min_tokens -1": ({"min_tokens": -1}, "min_tokens"),
    "seed 2**64": ({"seed": 2**64}, "seed"),
    "seed below int64": ({"seed": -(2**63) - 1}, "seed"),
    "top_logprobs -1": ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    "top_logprobs 21": ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    "logprobs a string": ({"logprobs": "yes"}, "logprobs"),
    "temperature 10**400": ({"temperature": 10**400}, "temperature"),
    "temperature Infinity": ({"temperature": float("inf")}, "temperature"),
    "top_p NaN": ({"top_p": float("nan")}, "top_p"),
    "min_p a list": ({"min_p": [1]}, "min_p"),
    "logit_bias key too big": ({"logit_bias": {"99999999999": 1}}, "logit_bias"),
    "logit_bias key a superscript digit": ({"logit_bias": {"\u00b2": 1}}, "logit_bias"),
    "logit_bias value true": ({"logit_bias": {"5": True}}, "logit_bias"),
    "logit_bias value NaN": ({"logit_bias": {"5": float("nan")}}, "logit_bias"),
    "logit_bias value Infinity": ({"logit_bias": {"5": float("-inf")}}, "logit_bias"),
    # Past what int() and float() take: a 500 with a traceback before
    "logit_bias key of 5,000 digits": ({"logit_bias": {"9" * 5000: 1}}, "logit_bias"),
    "logit_bias value 10**400": ({"logit_bias": {"5": 10**400}}, "logit_bias"),
    "logit_bias value -10**400": ({"logit_bias": {"5": -(10**400)}}, "logit_bias"),
    "n 17, over the choices a request may ask": ({"n": 17}, "n"),
    "n 0": ({"n": 0}, "n"),
    "n 1.5": ({"n": 1.5}, "n"),
    "best_of below n": ({"n": 3, "best_of": 2}, "best_of"),
    "best_of above n: candidates ranked": ({"n": 2, "best_of": 4}, "best_of"),
    "max_completion_tokens a string": ({"max_completion_tokens": "9"}, "max_completion_tokens"),
    # Both spellings are read as OpenAI's and vLLM's schemas read them: the one not used is no
    # place for anything (max_tokens "x" passed beside a max_completion_tokens)
    "max_tokens a string beside max_completion_tokens": (
        {"max_completion_tokens": 9, "max_tokens": "9"}, "max_tokens"
    ),
    "max_tokens 0 beside max_completion_tokens": (
        {"max_completion_tokens": 9, "max_tokens": 0}, "max_tokens"
    ),
    "user a number": ({"user": 5}, "user"),
    "a message's name a number": (
        {"messages": [{"role": "user", "name": 5, "content": "hi"}]}, "messages[0].name"
    ),
    "response_format a string": ({"response_format": "json_object"}, "response_format"),
    # vLLM's extras the decoder has, read as vLLM's schema types them
    "stop_token_ids a string": ({"stop_token_ids": "5"}, "stop_token_ids"),
    "stop_token_ids of 65": ({"stop_token_ids": [5] * 65}, "stop_token_ids"),
    "stop_token_ids with -1": ({"stop_token_ids": [5, -1]}, "stop_token_ids[1]"),
    "stop_token_ids with true": ({"stop_token_ids": [True]}, "stop_token_ids[0]"),
    "stop_token_ids with 2**32": ({"stop_token_ids": [2**32]}, "stop_token_ids[0]"),
    "include_stop_str_in_output 1": ({"include_stop_str_in_output": 1}, "include_stop_str_in_output"),
    "add_generation_prompt a string": ({"add_generation_prompt": "no"}, "add_generation_prompt"),
    "chat_template a number": ({"chat_template": 5}, "chat_template"),
    # A caller's template is code the decoder runs: refused as vLLM refuses it by default
    "a chat_template": ({"chat_template": "{{ x }}"}, "chat_template"),
    "a chat_template among the kwargs": (
        {"chat_template_kwargs": {"chat_template": "{{ x }}"}}, "chat_template_kwargs.chat_template"
    ),
    "chat_template_kwargs a list": ({"chat_template_kwargs": []}, "chat_template_kwargs"),
    "chat_template_kwargs of 10**400": ({"chat_template_kwargs": {"a": 10**400}}, "chat_template_kwargs.a"),
    "chat_template_kwargs of 2**53 + 1": (
        {"chat_template_kwargs": {"a": [2**53 + 1]}}, "chat_template_kwargs.a[0]"
    ),
    "chat_template_kwargs of NaN": ({"chat_template_kwargs": {"a": [float("nan")]}}, "chat_template_kwargs"),
    "chat_template_kwargs of 257 fields": (
        {"chat_template_kwargs": {str(i): 1 for i in range(257)}}, "chat_template_kwargs"
    ),
    # vLLM's extras the decoder has not: refused rather than answered otherwise (a sample, not a beam)
    "use_beam_search": ({"use_beam_search": True}, "use_beam_search"),
    "continue_final_message": ({"continue_final_message": True}, "continue_final_message"),
    "a chat's echo": ({"echo": True}, "echo"),
    "allowed_token_ids": ({"allowed_token_ids": [5]}, "allowed_token_ids"),
    "bad_words": ({"bad_words": ["x"]}, "bad_words"),
    # A wrong type is refused whatever its truthiness: these falsy ones were read as not asked
    "use_beam_search an empty string": ({"use_beam_search": ""}, "use_beam_search"),
    "use_beam_search 0": ({"use_beam_search": 0}, "use_beam_search"),
    "tools 0": ({"tools": 0}, "tools"),
    "tools an empty object": ({"tools": {}}, "tools"),
    "functions an empty string": ({"functions": ""}, "functions"),
    "allowed_token_ids 0": ({"allowed_token_ids": 0}, "allowed_token_ids"),
    "allowed_token_ids empty: no token allowed": ({"allowed_token_ids": []}, "allowed_token_ids"),
    "bad_words false": ({"bad_words": False}, "bad_words"),
    "tool_choice 0": ({"tool_choice": 0}, "tool_choice"),
    "a message's tool_calls 0": (
        {"messages": [{"role": "assistant", "content": "", "tool_calls": 0}]}, "messages[0].tool_calls"
    ),
    "a message's function_call an empty string": (
        {"messages": [{"role": "assistant", "content": "", "function_call": ""}]}, "messages[0].function_call"
    ),
    # A history's tool call was dropped from the rendered chat, its tool's answer kept: refused as tools are
    "an assistant's tool_calls": (
        {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "a"}]}]},
        "messages[0].tool_calls",
    ),
    "an assistant's function_call": (
        {"messages": [{"role": "assistant", "content": "", "function_call": {"name": "f"}}]},
        "messages[0].function_call",
    ),
    "stop a number": ({"stop": 5}, "stop"),
    "stop of 17": ({"stop": ["x"] * 17}, "stop"),
    "rows with a bool dimension": (_user(_rows(shape=[True, 4])), "messages[0].content[0].embeddings.shape"),
    "rows of 2**70": (_user(_rows(shape=[2**70, 4])), "messages[0].content[0].embeddings.shape"),
    "rows with an unhashable dtype": (_user(_rows(dtype=["x"])), "messages[0].content[0].embeddings.dtype"),
    "a remote image URL": (
        _user({"type": "image_url", "image_url": {"url": "http://x/y.png"}}),
        "messages[0].content[0].image_url",
    ),
    "17 images": (_user(*[URL] * 17), "messages"),
    "257 messages": ({"messages": [{"role": "user", "content": "hi"}] * 257}, "messages"),
    "257 parts in all": ({"messages": [_user(*[TEXT] * 129)["messages"][0]] * 2}, "messages"),
    "1025 logit_bias entries": ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
    "1025 choices": ({"guided_choice": ["x"] * 1025}, "guided_choice"),
    "guided_choice of numbers": ({"guided_choice": [1]}, "guided_choice"),
    # OpenAI and vLLM refuse these rather than answer something else than what was asked
    "stream a string": ({"stream": "true"}, "stream"),
    "stream 1": ({"stream": 1}, "stream"),
    "stream_options without stream": ({"stream_options": {"include_usage": True}}, "stream_options"),
    "stream_options a string": ({"stream": True, "stream_options": "x"}, "stream_options"),
    "include_usage a string": (
        {"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"
    ),
    "tool_choice required": ({"tool_choice": "required"}, "tool_choice"),
    "tool_choice a function": (
        {"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"
    ),
    "function_call a function": ({"function_call": {"name": "f"}}, "function_call"),
    "top_logprobs without logprobs": ({"top_logprobs": 5}, "top_logprobs"),
    "top_logprobs with logprobs false": ({"logprobs": False, "top_logprobs": 0}, "top_logprobs"),
    "a text part without its text": (_user({"type": "text"}), "messages[0].content[0].text"),
    "a text part of a number": (_user({"type": "text", "text": 5}), "messages[0].content[0].text"),
    # vLLM >= 0.12's spelling of structured output: its keys Tandem lacks, and two at once, are refused
    "structured_outputs a list": ({"structured_outputs": ["x"]}, "structured_outputs"),
    "structured_outputs.choice of numbers": (
        {"structured_outputs": {"choice": [1]}}, "structured_outputs.choice"
    ),
    "structured_outputs.regex a number": ({"structured_outputs": {"regex": 5}}, "structured_outputs.regex"),
    "structured_outputs.json a number": ({"structured_outputs": {"json": 5}}, "structured_outputs.json"),
    "structured_outputs.json_object a string": (
        {"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object"
    ),
    # vLLM types these str or list: false is refused there, and dropped here it answered free text
    "structured_outputs.regex false": ({"structured_outputs": {"regex": False}}, "structured_outputs.regex"),
    "structured_outputs.grammar false": (
        {"structured_outputs": {"grammar": False}}, "structured_outputs.grammar"
    ),
    "structured_outputs.choice false": (
        {"structured_outputs": {"choice": False}}, "structured_outputs.choice"
    ),
    "structured_outputs of two kinds": (
        {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice"
    ),
    "structured_outputs.structural_tag": (
        {"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"
    ),
    "structured_outputs.whitespace_pattern": (
        {"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"
    ),
    "structured_outputs.disable_any_whitespace": (
        {"structured_outputs": {"json_object": True, "disable_any_whitespace": True}},
        "structured_outputs.disable_any_whitespace",
    ),
    "structured_outputs.disable_fallback a string": (
        {"structured_outputs": {"disable_fallback": "no"}}, "structured_outputs.disable_fallback"
    ),
    "structured_outputs beside guided_choice": (
        {"guided_choice": ["a"], "structured_outputs": {"choice": ["b"]}}, "structured_outputs.choice"
    ),
    "structured_outputs beside response_format": (
        {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
        "structured_outputs.regex",
    ),
    # vLLM's extras on tokenizing, done one way here: any other way is refused, not answered as if done
    "truncate_prompt_tokens": ({"truncate_prompt_tokens": 3}, "truncate_prompt_tokens"),
    "truncate_prompt_tokens -1": ({"truncate_prompt_tokens": -1}, "truncate_prompt_tokens"),
    "skip_special_tokens false": ({"skip_special_tokens": False}, "skip_special_tokens"),
    "spaces_between_special_tokens false": (
        {"spaces_between_special_tokens": False}, "spaces_between_special_tokens"
    ),
    "add_special_tokens true": ({"add_special_tokens": True}, "add_special_tokens"),
    "return_tokens_as_token_ids true": ({"return_tokens_as_token_ids": True}, "return_tokens_as_token_ids"),
    "skip_special_tokens a string": ({"skip_special_tokens": "false"}, "skip_special_tokens"),
    "parallel_tool_calls a string": ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    "parallel_tool_calls 0": ({"parallel_tool_calls": 0}, "parallel_tool_calls"),
    # Rounded to the decoder's float32 the value was 0.0 or inf, which the decoder refused as such
    "top_p below float32's least": ({"top_p": 1e-46}, "top_p"),
    "temperature past float32": ({"temperature": 1e39}, "temperature"),
    "logit_bias value past float32": ({"logit_bias": {"5": -1e39}}, "logit_bias"),
}  # fmt: skip


@pytest.mark.parametrize("name", HOSTILE_CHAT)
def test_a_hostile_chat_body_is_invalid_argument_naming_the_field(name: str) -> None:
    extra, field = HOSTILE_CHAT[name]
    with pytest.raises(InvalidArgument) as error:
        chat_request(CHAT | extra, LIMITS)
    assert error.value.field == field, str(error.value)


@pytest.mark.parametrize(
    ("prompt", "field"),
    [
        ([-1], "prompt"),
        ([2**32], "prompt"),
        (["a", [-1]], "prompt[1]"),
        (["a", [True]], "prompt[1]"),
        (5, "prompt"),
        ([1] * 257, "prompt"),
        (["a"] * 257, "prompt"),
        ([[1] * 257], "prompt"),
        (["a", [1] * 200, [1] * 57], "prompt"),  # segments of one prompt: their IDs in all
        (["a"] * 17, "prompt"),  # a batch of more prompts than choices a request may ask
        ([[1, 2], []], "prompt[1]"),
        ([[1], [2**32]], "prompt[1]"),
        ([[1] * 257, [1]], "prompt[0]"),  # each prompt of a batch is bounded by the context
        ([[1], [True]], "prompt[1]"),
    ],
)
def test_hostile_completion_prompts_are_invalid_argument(prompt: object, field: str) -> None:
    with pytest.raises(InvalidArgument) as error:
        completion_request({"prompt": prompt}, LIMITS)
    assert error.value.field == field


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"input": [-1]}, "input"),
        ({"input": [[2**32]]}, "input[0]"),
        ({"input": [True]}, "input[0]"),
        ({"input": "x", "tandem_pooling": "none"}, "encoding_format"),
        ({"input": ["x"] * 65}, "input"),
        ({"input": [1] * 65}, "input"),
        ({"input": [[1] * 65]}, "input[0]"),
        ({"input": "x", "user": ["u"]}, "user"),
    ],
)
def test_hostile_embedding_inputs_are_invalid_argument(body: dict, field: str) -> None:
    with pytest.raises(InvalidArgument) as error:
        embed_request(body, EMBED_LIMITS)
    assert error.value.field == field


def test_a_wide_list_is_refused_from_its_length_before_any_element_is_read() -> None:
    class Unreadable(list):
        """A list whose elements must not be looked at: only its length."""

        def __iter__(self):
            raise AssertionError("an element was read")

    wide = Unreadable([0] * 10_000)
    for convert, body, limits in (
        (completion_request, {"prompt": wide}, LIMITS),
        (embed_request, {"input": wide}, EMBED_LIMITS),
        (chat_request, {"messages": wide}, LIMITS),
        (chat_request, CHAT | {"stop": wide}, LIMITS),
        (chat_request, CHAT | {"guided_choice": wide}, LIMITS),
    ):
        with pytest.raises(InvalidArgument, match="exceed the limit|at most"):
            convert(body, limits)


def test_an_image_url_part_becomes_an_empty_image_part_with_its_file_kept_in_order() -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAEC"}}
    body = {
        "messages": [
            {"role": "user", "content": "a"},
            {"role": "user", "content": [{"type": "text", "text": "b"}, image]},
        ]
    }
    call = chat_request(body, LIMITS)
    assert call.images == (ImagePart(1, 1, b"\x00\x01\x02"),)
    part = call.requests[0].chat.messages[1].content[1]
    assert part.WhichOneof("part") == "image" and part.image.ByteSize() == 0


def test_for_a_decoder_with_an_encoder_an_image_url_part_becomes_an_encoder_part_of_its_file() -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAEC"}}
    content = [image, {"type": "text", "text": "b"}, image]
    call = chat_request({"messages": [{"role": "user", "content": content}]}, LIMITS)
    as_encoder_parts(call)
    parts = call.requests[0].chat.messages[0].content
    assert [part.WhichOneof("part") for part in parts] == ["encoder", "text", "encoder"]
    assert [parts[0].encoder.image.data, parts[2].encoder.image.data] == [b"\x00\x01\x02"] * 2


def test_a_request_takes_as_many_pictures_whichever_endpoint_it_is_sent_to() -> None:
    # Each picture holds the encoder's one image thread; 64 embedding inputs may be text, not pictures.
    picture = "AAEC"
    chat_image = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{picture}"}}
    embed_image = {"type": "tandem_image", "data": picture}
    chat = {"messages": [{"role": "user", "content": [chat_image] * MAX_IMAGES}]}
    embed = {"input": [embed_image] * MAX_IMAGES + ["text"] * 8}
    assert len(chat_request(chat, LIMITS).images) == len(embed_request(embed, EMBED_LIMITS).requests) - 8
    chat["messages"][0]["content"].append(chat_image)
    embed["input"].append(embed_image)
    for convert, body, limits, refusal in (
        (chat_request, chat, LIMITS, f"at most {MAX_IMAGES} image_url parts"),
        (embed_request, embed, EMBED_LIMITS, f"{MAX_IMAGES + 1} tandem_image inputs"),
    ):
        with pytest.raises(InvalidArgument, match=refusal) as error:
            convert(body, limits)
        assert str(MAX_IMAGES) in str(error.value)


def test_two_logit_bias_keys_naming_one_token_are_refused_naming_both() -> None:
    # OpenAI's keys are token ID strings; "05" and "5" are one ID, whose bias the later key took silently.
    with pytest.raises(InvalidArgument) as error:
        chat_request(CHAT | {"logit_bias": {"05": 1, "7": 3, "5": 2}}, LIMITS)
    assert error.value.field == "logit_bias"
    assert "keys '05' and '5' both name token 5" in str(error.value)
    call = chat_request(CHAT | {"logit_bias": {"05": 1, "7": 3}}, LIMITS)
    assert dict(call.requests[0].sampling.logit_bias) == {5: 1.0, 7: 3.0}


def test_logit_bias_takes_any_uint32_key_however_padded_and_any_number_as_a_float() -> None:
    # Its range ([-100, 100]) is the decoder's to check, against the vocabulary too.
    biases = {"0" * 20 + "4294967295": 100, "7": -100.0, "8": 2**24}
    call = chat_request(CHAT | {"logit_bias": biases}, LIMITS)
    assert dict(call.requests[0].sampling.logit_bias) == {2**32 - 1: 100.0, 7: -100.0, 8: 2.0**24}


def test_a_logit_bias_key_padded_past_what_int_reads_is_still_its_token() -> None:
    # int() of the whole key raised on its 5,000 zeros (Python's bound on a str's digits): a 500.
    padded = "0" * 5000 + "5"
    call = chat_request(CHAT | {"logit_bias": {padded: 1}}, LIMITS)
    assert dict(call.requests[0].sampling.logit_bias) == {5: 1.0}
    with pytest.raises(InvalidArgument, match="both name token 5") as error:
        chat_request(CHAT | {"logit_bias": {padded: 1, "5": 2}}, LIMITS)
    assert error.value.field == "logit_bias"
    with pytest.raises(InvalidArgument) as error:
        chat_request(CHAT | {"logit_bias": {"0" * 5000 + "4294967296": 1}}, LIMITS)
    assert error.value.field == "logit_bias"


def test_what_the_answer_needs_of_the_body_is_kept() -> None:
    call = chat_request(
        CHAT
        | {"model": "m", "stream": True, "stream_options": {"include_usage": True}, "guided_regex": "a+"},
        LIMITS,
    )
    assert (call.model, call.is_stream, call.include_usage, call.names.structured) == (
        "m",
        True,
        True,
        "guided_regex",
    )
    plain = completion_request({"prompt": "hi"}, LIMITS)
    assert (plain.is_stream, plain.include_usage, plain.names.structured) == (False, False, None)


def test_a_tool_choice_that_asks_for_text_is_answered_with_text() -> None:
    for choice in ("none", "auto"):
        assert chat_request(CHAT | {"tool_choice": choice, "function_call": choice}, LIMITS).requests


def test_extras_of_their_type_that_ask_for_nothing_pass() -> None:
    # null where OpenAI allows it, false, and empty lists (clients send tools: [] on plain turns)
    quiet = {
        "use_beam_search": False,
        "tools": [],
        "functions": None,
        "bad_words": [],
        "allowed_token_ids": None,
    }
    history = [
        {"role": "assistant", "content": "a", "tool_calls": [], "function_call": None},
        CHAT["messages"][0],
    ]
    assert chat_request(CHAT | quiet | {"messages": history}, LIMITS).requests


def test_a_tool_turn_is_rendered_as_sent_whatever_comes_before_it() -> None:
    # As vLLM: no pairing of a tool's answer with a call is checked. A call in the history is refused
    # (it would be dropped, its answer kept); a tool turn the caller sends alone is what the model reads.
    history = [CHAT["messages"][0], {"role": "tool", "content": "42", "tool_call_id": "a"}]
    turn = chat_request({"messages": history}, LIMITS).requests[0].chat.messages[1]
    assert (turn.role, [part.text for part in turn.content]) == ("tool", ["42"])


@pytest.mark.parametrize("role", ["assistant", "user", "system", "tool"])
def test_a_turn_with_no_content_or_an_empty_list_is_one_of_no_text_whatever_its_role(role: str) -> None:
    # vLLM's parse_chat_message_content reads a missing or null content as [] for every role, and renders
    # [] as empty text; the SDK types assistant content as a list of parts. Only an assistant's null was
    # taken: a user turn with no content, and [] of any role, were told to be a string.
    silent = ({"content": None, "tool_calls": []}, {"function_call": None}, {"content": []}, {})
    for fields in silent:
        history = [CHAT["messages"][0], {"role": role} | fields, CHAT["messages"][0]]
        turn = chat_request({"messages": history}, LIMITS).requests[0].chat.messages[1]
        assert [part.text for part in turn.content] == [""]
    with pytest.raises(InvalidArgument, match=r"^messages\[0\]\.content: must be a string"):
        chat_request({"messages": [{"role": "user", "content": 0}]}, LIMITS)


@pytest.mark.parametrize(
    ("seed", "decoder_seed"), [(-1, 2**64 - 1), (-(2**63), 2**63), (0, 0), (2**64 - 1, 2**64 - 1)]
)
def test_vllms_negative_int64_seeds_are_their_twos_complement(seed: int, decoder_seed: int) -> None:
    # vLLM takes a seed in int64's range; the decoder's is a uint64. A negative one was refused.
    assert chat_request(CHAT | {"seed": seed}, LIMITS).requests[0].sampling.seed == decoder_seed


def test_a_seed_outside_int64_and_uint64_names_the_range() -> None:
    with pytest.raises(InvalidArgument) as error:
        chat_request(CHAT | {"seed": 2**64}, LIMITS)
    assert str(error.value) == (
        f"seed: must be in [{-(2**63)}, {2**64 - 1}] (int64's negatives as their two's complement), "
        f"got {2**64}"
    )


def test_a_messages_name_reaches_the_chat_template() -> None:
    # vLLM gives it to the template; it was checked and dropped.
    history = [{"role": "user", "name": "alice", "content": "hi"}, {"role": "user", "content": "yo"}]
    named, unnamed = chat_request({"messages": history}, LIMITS).requests[0].chat.messages
    assert (named.name, unnamed.HasField("name")) == ("alice", False)


def test_vllms_top_k_minus_one_means_off() -> None:
    assert chat_request(CHAT | {"top_k": -1}, LIMITS).requests[0].sampling.top_k == 0


def test_vllms_stopping_extras_reach_the_decoder_from_either_endpoint() -> None:
    # They were dropped: generation went on past a stop token the caller named.
    extras = {"stop_token_ids": [7, 0, 2**32 - 1], "include_stop_str_in_output": True}
    for call in (chat_request(CHAT | extras, LIMITS), completion_request({"prompt": "a"} | extras, LIMITS)):
        stopping = call.requests[0].stopping
        assert list(stopping.stop_token_ids) == [7, 0, 2**32 - 1] and stopping.include_stop_in_output
    plain = chat_request(CHAT | {"stop_token_ids": None, "include_stop_str_in_output": False}, LIMITS)
    assert not plain.requests[0].stopping.stop_token_ids
    assert not plain.requests[0].stopping.include_stop_in_output


def test_vllms_chat_template_extras_reach_the_chat_prompt() -> None:
    # Qwen3's {"enable_thinking": false} was dropped: the model thought aloud anyway.
    kwargs = {"enable_thinking": False, "documents": [{"title": "x", "n": 2}], "note": None}
    extras = {"add_generation_prompt": False, "chat_template": None, "chat_template_kwargs": kwargs}
    chat = chat_request(CHAT | extras, LIMITS).requests[0].chat
    assert chat.HasField("add_generation_prompt") and not chat.add_generation_prompt
    assert json_format.MessageToDict(chat.template_kwargs) == kwargs
    plain = chat_request(CHAT, LIMITS).requests[0].chat
    assert not plain.HasField("add_generation_prompt") and not plain.HasField("chat_template")
    assert not plain.HasField("template_kwargs")


def test_vllms_merge_of_the_kwargs_over_add_generation_prompt_and_documents() -> None:
    # vLLM builds dict(add_generation_prompt=..., documents=...) from the body, then updates it with the
    # kwargs: a kwarg overrides either. Here kwargs' add_generation_prompt was a 400, and the body's
    # documents (Command-R's and Granite's RAG templates read them) were dropped, a 200 without them.
    docs = [{"title": "t", "text": "x"}]
    kwargs = {"add_generation_prompt": False, "enable_thinking": False}
    chat = chat_request(CHAT | {"add_generation_prompt": True, "chat_template_kwargs": kwargs}, LIMITS)
    assert not chat.requests[0].chat.add_generation_prompt
    assert json_format.MessageToDict(chat.requests[0].chat.template_kwargs) == {"enable_thinking": False}
    chat = chat_request(CHAT | {"documents": docs}, LIMITS)
    assert json_format.MessageToDict(chat.requests[0].chat.template_kwargs) == {"documents": docs}
    overridden = {"documents": docs, "chat_template_kwargs": {"documents": [{"text": "kw"}]}}
    chat = chat_request(CHAT | overridden, LIMITS)
    assert json_format.MessageToDict(chat.requests[0].chat.template_kwargs) == {"documents": [{"text": "kw"}]}
    refusals = {
        "chat_template_kwargs.add_generation_prompt": {"chat_template_kwargs": {"add_generation_prompt": 1}},
        "documents": {"documents": {"title": "t"}},
        "documents[0]": {"documents": ["x"]},
        "documents[0].n": {"documents": [{"n": 2**53 + 1}]},
    }
    for name, extras in refusals.items():
        with pytest.raises(InvalidArgument) as error:
            chat_request(CHAT | extras, LIMITS)
        assert error.value.field == name, error.value


def test_a_bodys_documents_have_their_own_budget_and_are_named_documents() -> None:
    # They were counted in the kwargs' 256 fields (a handful of flags) and refused as
    # chat_template_kwargs: 128 documents of {title, text}, which vLLM takes, were a 400.
    rag = [{"title": f"t{i}", "text": "x"} for i in range(1000)]  # 3,000 fields
    chat = chat_request(CHAT | {"documents": rag, "chat_template_kwargs": {"a": list(range(250))}}, LIMITS)
    assert len(chat.requests[0].chat.template_kwargs["documents"]) == 1000
    deep: object = "x"
    for _ in range(40):
        deep = {"a": deep}
    refusals = {
        ("documents", "holds more than the limit of 4096 fields"): [{"t": "x"}] * 4097,
        ("documents", "nests deeper than"): [deep],
        ("documents", "must hold finite numbers"): [{"t": float("nan")}],
    }
    for (name, said), documents in refusals.items():
        for extras in ({"documents": documents}, {"chat_template_kwargs": {"documents": documents}}):
            with pytest.raises(InvalidArgument) as error:
                chat_request(CHAT | extras, LIMITS)
            expected = name if "documents" in extras else f"chat_template_kwargs.{name}"
            assert (error.value.field, said in error.value.description) == (expected, True), error.value
    # The kwargs keep theirs, the documents' key one of them.
    with pytest.raises(InvalidArgument) as error:
        chat_request(CHAT | {"documents": rag, "chat_template_kwargs": {"a": list(range(255))}}, LIMITS)
    assert error.value.field == "chat_template_kwargs"


def test_a_completion_refuses_what_it_would_otherwise_ignore() -> None:
    with pytest.raises(InvalidArgument, match="suffix: is not supported"):
        completion_request({"prompt": "a", "suffix": "b"}, LIMITS)
    with pytest.raises(InvalidArgument, match="echo: is not supported"):
        completion_request({"prompt": "a", "echo": True}, LIMITS)


def test_prompt_segments_still_mix_kinds_and_a_batch_of_one_is_its_prompt() -> None:
    mixed = completion_request({"prompt": ["a", [5, 6], "b"]}, LIMITS)
    assert not mixed.is_batch and len(mixed.requests) == 1
    assert [s.WhichOneof("segment") for s in mixed.requests[0].prompt] == ["text", "token_ids", "text"]
    rows = completion_request({"prompt": ["a", _rows()]}, LIMITS)
    assert [s.WhichOneof("segment") for s in rows.requests[0].prompt] == ["text", "embeddings"]
    assert not rows.is_batch and len(rows.requests) == 1
    one = completion_request({"prompt": ["a"]}, LIMITS)
    assert not one.is_batch and [s.text for s in one.requests[0].prompt] == ["a"]
    streamed = chat_request(CHAT | {"stream": True, "stream_options": {"include_usage": True}}, LIMITS)
    assert streamed.is_stream and streamed.include_usage
    assert not chat_request(CHAT | {"stream": False, "stream_options": None}, LIMITS).is_stream
    assert not chat_request(CHAT | {"stream_options": {}}, LIMITS).include_usage  # vLLM lets {} pass


def test_an_embeddings_error_is_named_after_the_input_that_failed() -> None:
    several = embed_request({"input": ["a", [1, 2], {"type": "tandem_image", "data": "AA=="}]}, EMBED_LIMITS)
    assert several.input_field(0, "text") == "input[0]"
    assert several.input_field(1, "token_ids.ids[1]") == "input[1][1]"
    assert several.input_field(2, "image") == "input[2].data"
    assert several.input_field(2, "model") == "model"  # not an input's field
    assert embed_request({"input": "a"}, EMBED_LIMITS).input_field(0, "text") == "input"


def test_a_chat_without_max_tokens_runs_until_it_stops_or_the_context_is_full() -> None:
    stopping = chat_request(CHAT, LIMITS).requests[0].stopping
    assert stopping.cap_to_context and not stopping.HasField("max_new_tokens")  # not the decoder's 256
    for name in ("max_tokens", "max_completion_tokens"):  # the caller's bound, which must fit
        stopping = chat_request(CHAT | {name: 300}, LIMITS).requests[0].stopping
        assert (stopping.max_new_tokens, stopping.cap_to_context) == (300, False)


def test_a_completion_without_max_tokens_takes_16_cut_to_the_context() -> None:
    for prompt in ("a", ["a", "b"]):
        for request in completion_request({"prompt": prompt}, LIMITS).requests:
            assert (request.stopping.max_new_tokens, request.stopping.cap_to_context) == (16, True)
    stopping = completion_request({"prompt": "a", "max_tokens": 300}, LIMITS).requests[0].stopping
    assert (stopping.max_new_tokens, stopping.cap_to_context) == (300, False)


@pytest.mark.parametrize(
    ("asked", "structured"),
    [
        ({"json": {"type": "object"}}, {"jsonSchema": '{"type": "object"}'}),
        ({"json": '{"type": "string"}'}, {"jsonSchema": '{"type": "string"}'}),
        ({"regex": "[ab]"}, {"regex": "[ab]"}),
        ({"choice": ["yes", "no"]}, {"choice": {"choices": ["yes", "no"]}}),
        ({"grammar": 'root ::= "a"'}, {"grammar": 'root ::= "a"'}),
        ({"json_object": True}, {"jsonObject": True}),
        # the schema no value satisfies, as guided_json's false: the decoder refuses it naming the key
        ({"json": False}, {"jsonSchema": "false"}),
        # vLLM's defaults of what Tandem lacks pass; disable_fallback holds (there is no other backend)
        ({"regex": "a", "json_object": False, "structural_tag": None}, {"regex": "a"}),
        ({"regex": "a", "disable_any_whitespace": False, "disable_fallback": True}, {"regex": "a"}),
    ],
)
def test_structured_outputs_is_the_constraint_its_guided_spelling_asks(asked: dict, structured: dict) -> None:
    for convert, body in ((chat_request, CHAT), (completion_request, {"prompt": "a"})):
        call = convert(body | {"structured_outputs": asked}, LIMITS)
        assert json_format.MessageToDict(call.requests[0].structured) == structured
        assert call.names.structured == f"structured_outputs.{next(iter(asked))}"


def test_structured_outputs_asking_for_nothing_is_no_constraint_and_a_key_beside_nulls_is_one() -> None:
    for asked in ({}, {"json_object": False}, {"json": None}):
        call = chat_request(CHAT | {"structured_outputs": asked}, LIMITS)
        assert not call.requests[0].HasField("structured") and call.names.structured is None
    call = chat_request(CHAT | {"structured_outputs": {"json": None, "regex": "a"}}, LIMITS)
    assert call.requests[0].structured.regex == "a"


def test_a_decoders_error_on_a_structured_outputs_key_names_that_key() -> None:
    names = chat_request(CHAT | {"structured_outputs": {"regex": "("}}, LIMITS).names
    assert body_field("structured.regex", names) == "structured_outputs.regex"


def test_tokenizing_extras_pass_as_done_here_or_null_and_are_refused_saying_what_is_done() -> None:
    body = CHAT | {
        "skip_special_tokens": True,
        "spaces_between_special_tokens": True,
        "add_special_tokens": False,
        "return_tokens_as_token_ids": False,
        "truncate_prompt_tokens": None,
        "parallel_tool_calls": False,  # OpenAI's bool: with tools refused, no call is made either way
    }
    assert chat_request(body, LIMITS).requests[0].chat.messages
    assert completion_request({"prompt": "a", "parallel_tool_calls": True}, LIMITS).requests
    with pytest.raises(InvalidArgument) as error:
        completion_request({"prompt": "a", "skip_special_tokens": False}, LIMITS)
    assert str(error.value) == (
        "skip_special_tokens: is not supported as false: the answer's text leaves special tokens out"
    )


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"top_p": 1e-46}, "top_p: 1e-46 rounds to 0 in float32, the decoder's type"),
        ({"temperature": 1e39}, "temperature: 1e+39 overflows float32, the decoder's type"),
        ({"min_p": -1e-50}, "min_p: -1e-50 rounds to 0 in float32, the decoder's type"),
        ({"n": 0}, "n: must be in [1, 16] (the gateway's --max-choices"),
        ({"n": -1}, "n: must be in [1, 16] (the gateway's --max-choices"),
    ],
)
def test_a_refused_number_is_shown_as_sent_with_the_bound_that_holds(extra: dict, message: str) -> None:
    with pytest.raises(InvalidArgument) as error:
        chat_request(CHAT | extra, LIMITS)
    assert str(error.value).startswith(message), str(error.value)


def test_numbers_float32_holds_pass_as_sent_and_those_it_does_not_are_refused() -> None:
    with pytest.raises(InvalidArgument, match="rounds to 0"):
        chat_request(CHAT | {"top_p": 1e-46}, LIMITS)
    sampling = (
        chat_request(CHAT | {"top_p": 1e-45, "temperature": 3.4e38, "min_p": 0}, LIMITS).requests[0].sampling
    )
    assert sampling.top_p > 0 and sampling.temperature == pytest.approx(3.4e38) and sampling.min_p == 0
