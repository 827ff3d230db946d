"""The client's messages for a decoder are built from plain Python values as the proto means them."""

from __future__ import annotations

import pytest

from tandem.client.errors import InvalidArgument
from tandem.client.generate_requests import chat_prompt


def test_a_chat_turns_name_is_carried_and_a_turn_without_one_sends_none() -> None:
    # ChatMessage.name (30308ec) reaches templates that print it (a participant's name); chat_prompt
    # dropped it, as the gateway did before 30308ec.
    prompt = chat_prompt(
        [{"role": "user", "name": "alice", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    )
    named, unnamed = prompt.messages
    assert named.HasField("name") and named.name == "alice"
    assert not unnamed.HasField("name")


@pytest.mark.parametrize("name", [["alice"], 123, False, {"a": 1}])
def test_a_name_that_is_not_a_string_is_refused_naming_the_turns_name(name: object) -> None:
    # str() sent ["alice"] as the name "['alice']" to the template, where the gateway refuses the body.
    with pytest.raises(InvalidArgument, match=r"^messages\[1\]\.name: must be a string, got "):
        chat_prompt([{"role": "user", "content": "hi"}, {"role": "user", "content": "yo", "name": name}])


@pytest.mark.parametrize(
    "message",
    [{"role": "assistant", "content": []}, {"role": "user", "content": None}, {"role": "user"}],
    ids=["empty-list", "none", "absent"],
)
def test_a_turn_with_no_content_parts_is_one_of_empty_text_as_the_gateway_sends_it(
    message: dict[str, object],
) -> None:
    # [] was sent as a turn of no parts, which the decoder refuses; None and absent raised here (TypeError,
    # KeyError). The gateway renders all three as empty text, as vLLM does (595fa60).
    prompt = chat_prompt([{"role": "user", "content": "hi"}, message])  # type: ignore[list-item]
    assert [part.text for part in prompt.messages[1].content] == [""]
    assert prompt.messages[1].content[0].HasField("text")


@pytest.mark.parametrize(
    "content",
    [False, 0, 0.0, {}, {"type": "text", "text": "hi"}, b"hi"],
    ids=["false", "zero", "zero-float", "empty-dict", "one-part-object", "bytes"],
)
def test_a_content_neither_a_string_nor_a_list_is_refused_naming_it_as_the_gateway_does(
    content: object,
) -> None:
    # `content or []` sent False, 0, 0.0 and {} as one part of empty text, and list() sent an OpenAI part
    # object not in a list as two texts, its keys "type" and "text"; the gateway refuses every one.
    with pytest.raises(
        InvalidArgument,
        match=r"^messages\[1\]\.content: must be a string or a list of content parts, got ",
    ):
        chat_prompt([{"role": "user", "content": "hi"}, {"role": "user", "content": content}])  # type: ignore[list-item]


def test_a_content_given_as_a_tuple_of_parts_is_still_sent_part_by_part() -> None:
    prompt = chat_prompt([{"role": "user", "content": ("a", [1, 2])}])
    assert [part.WhichOneof("part") for part in prompt.messages[0].content] == ["text", "token_ids"]
