"""The client's messages for a decoder are built from plain Python values as the proto means them."""

from __future__ import annotations

from tandem.client.client import chat_prompt


def test_a_chat_turns_name_is_carried_and_a_turn_without_one_sends_none() -> None:
    # ChatMessage.name (30308ec) reaches templates that print it (a participant's name); chat_prompt
    # dropped it, as the gateway did before 30308ec.
    prompt = chat_prompt(
        [{"role": "user", "name": "alice", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    )
    named, unnamed = prompt.messages
    assert named.HasField("name") and named.name == "alice"
    assert not unnamed.HasField("name")
