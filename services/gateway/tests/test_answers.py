"""Choices through the gateway, as users of vLLM's OpenAI server expect them: `n` choices and a
completion's batch of prompts, numbered prompt_index * n + j; streamed with each chunk's index, a
finish chunk per choice and one [DONE]; usage over every choice, each prompt counted once; one
failing choice fails the request, naming its prompt, and cancels the rest, as a caller that leaves
does. The decoder is the tests' fake (`fake_decoder.py`), whose answer spells its prompt and seed."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
from typing import Any, cast

import aiohttp
import pytest
from aiohttp import web

from tandem.client.pb.tandem.v1 import decoder_pb2
from tandem.gateway import answers, choice_json
from tandem.gateway.answer_bytes import AnswerBytes, Reservation
from tandem.gateway.responses import Completion

from .fake_decoder import fake_decoder, prompt_text
from .live_gateway import live_gateway
from .raw_http import COMPLETIONS_HEAD, connect, read_answer, send, unread_answer

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


async def _post(url: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as response:
        text = await response.text()
        if body.get("stream") and response.status == 200:
            assert text.endswith("\n\n")
            return response.status, [json.loads(e.removeprefix("data: ")) if e != "data: [DONE]" else "[DONE]"
                                     for e in text.strip().split("\n\n")]  # fmt: skip
        return response.status, json.loads(text)


async def test_n_gives_n_distinct_choices_indexed_in_order_and_reproducible_with_a_seed() -> None:
    async with fake_decoder() as (decoder, address), live_gateway(address) as url:
        status, answer = await _post(f"{url}/chat/completions", CHAT | {"n": 3, "seed": 7})
        _, again = await _post(f"{url}/chat/completions", CHAT | {"n": 3, "seed": 7})
    assert status == 200
    texts = [c["message"]["content"] for c in answer["choices"]]
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
    assert texts == ["<hi> seed=7", "<hi> seed=8", "<hi> seed=9"]  # seed + j: distinct
    assert [c["message"]["content"] for c in again["choices"]] == texts
    assert len({r.request_id for r in decoder.requests}) == 6  # every choice its own Generate call
    # The prompt is counted once, as vLLM and OpenAI count it; every choice's tokens are.
    usage = answer["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (2, 6, 8)


async def test_a_batch_of_two_prompts_times_n_two_is_numbered_prompt_by_prompt() -> None:
    async with fake_decoder() as (_, address), live_gateway(address) as url:
        for prompt, shown in ((["one", "two"], ["one", "two"]), ([[1, 2], [3]], ["ids:1,2", "ids:3"])):
            status, answer = await _post(
                f"{url}/completions", {"prompt": prompt, "n": 2, "seed": 0, "max_tokens": 2}
            )
            assert status == 200, answer
            assert [(c["index"], c["text"]) for c in answer["choices"]] == [
                (0, f"<{shown[0]}> seed=0"),
                (1, f"<{shown[0]}> seed=1"),
                (2, f"<{shown[1]}> seed=0"),
                (3, f"<{shown[1]}> seed=1"),
            ]
            prompt_tokens = len(shown[0]) + len(shown[1])  # each prompt once, not once per choice
            assert answer["usage"]["prompt_tokens"] == prompt_tokens
            assert answer["usage"]["completion_tokens"] == 8


async def test_a_list_that_is_one_prompt_is_still_one_prompt() -> None:
    rows = {"dtype": "float32", "shape": [1, 4], "data": "AAAAAAAAAAAAAAAAAAAAAA=="}
    async with fake_decoder() as (decoder, address), live_gateway(address) as url:
        for prompt in (["a", [5, 6], "b"], ["a", {"type": "tandem_embeddings", "embeddings": rows}], ["a"]):
            status, answer = await _post(f"{url}/completions", {"prompt": prompt})
            assert status == 200, answer
            assert len(answer["choices"]) == 1 and answer["choices"][0]["index"] == 0
    assert [len(r.prompt) for r in decoder.requests] == [3, 2, 1]
    assert prompt_text(decoder.requests[0]) == "aids:5,6b"


async def test_a_stream_carries_each_choices_index_its_own_finish_and_one_done() -> None:
    body = {"prompt": ["p", "q"], "n": 2, "stream": True, "stream_options": {"include_usage": True}}
    async with fake_decoder() as (_, address), live_gateway(address) as url:
        status, events = await _post(f"{url}/completions", body | {"max_tokens": 3})
    assert status == 200
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    *chunks, usage = events[:-1]
    text: dict[int, str] = {}
    finishes: dict[int, list[str]] = {}
    for chunk in chunks:
        (choice,) = chunk["choices"]
        assert choice["index"] not in finishes  # nothing of a choice after its finish
        text[choice["index"]] = text.get(choice["index"], "") + choice["text"]
        if choice["finish_reason"] is not None:
            finishes[choice["index"]] = [choice["finish_reason"]]
    assert text == {0: "<p> seed=none x", 1: "<p> seed=none x", 2: "<q> seed=none x", 3: "<q> seed=none x"}
    assert finishes == {i: ["length"] for i in range(4)}
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 12
    assert usage["usage"]["prompt_tokens"] == 2


async def test_a_chat_stream_opens_every_choice_and_gives_each_its_logprobs() -> None:
    body = CHAT | {"n": 2, "stream": True, "logprobs": True, "top_logprobs": 2}
    async with fake_decoder() as (_, address), live_gateway(address) as url:
        status, events = await _post(f"{url}/chat/completions", body)
        _, whole = await _post(
            f"{url}/chat/completions", CHAT | {"n": 2, "logprobs": True, "top_logprobs": 2}
        )
    assert status == 200
    openings = [c["choices"][0] for c in events[:2]]
    assert [(o["index"], o["delta"]) for o in openings] == [
        (i, {"role": "assistant", "content": ""}) for i in (0, 1)
    ]
    for index in (0, 1):
        entries = [
            entry
            for chunk in events[2:-1]
            for choice in chunk["choices"]
            if choice["index"] == index and choice["logprobs"] is not None
            for entry in choice["logprobs"]["content"]
        ]
        assert [e["token"] for e in entries] == ["<hi>", " seed=none"]
        assert all(len(e["top_logprobs"]) == 2 for e in entries)
        assert [e["token"] for e in whole["choices"][index]["logprobs"]["content"]] == ["<hi>", " seed=none"]


async def test_a_completion_streams_text_offsets_per_choice() -> None:
    body = {"prompt": "ab", "n": 2, "stream": True, "logprobs": 1, "max_tokens": 2}
    async with fake_decoder() as (_, address), live_gateway(address) as url:
        _, events = await _post(f"{url}/completions", body)
    for index in (0, 1):
        offsets = [
            offset
            for chunk in events[:-1]
            for choice in chunk["choices"]
            if choice["index"] == index and choice["logprobs"] is not None
            for offset in choice["logprobs"]["text_offset"]
        ]
        assert offsets == [0, len("<ab>")]  # each choice's text counted from its own start


@pytest.mark.parametrize(
    ("path", "body", "param", "limit"),
    [
        ("/chat/completions", CHAT | {"n": 5}, "n", "4"),
        ("/completions", {"prompt": "a", "n": 5}, "n", "4"),
        ("/completions", {"prompt": ["a", "b", "c"], "n": 2}, "prompt", "4"),
        ("/completions", {"prompt": ["a"] * 5}, "prompt", "4"),
        ("/completions", {"prompt": ["a", "b"], "n": 2, "best_of": 3}, "best_of", "2"),
    ],
)
async def test_a_request_over_the_choices_limit_is_a_400_naming_the_field_and_the_limit(
    path: str, body: dict[str, Any], param: str, limit: str
) -> None:
    async with fake_decoder() as (decoder, address), live_gateway(address, max_choices=4) as url:
        status, answer = await _post(url + path, body)
    assert status == 400
    assert answer["error"]["param"] == param and limit in answer["error"]["message"], answer
    assert decoder.requests == []  # refused before any call


async def test_the_choices_limit_is_never_over_a_callers_streams() -> None:
    async with fake_decoder() as (decoder, address), live_gateway(address, max_streams_per_caller=3) as url:
        status, answer = await _post(f"{url}/chat/completions", CHAT | {"n": 4})
        assert (status, answer["error"]["param"]) == (400, "n")
        assert "3" in answer["error"]["message"] and "--max-streams-per-caller" in answer["error"]["message"]
        async with aiohttp.ClientSession() as session:
            hanging = CHAT | {"messages": [{"role": "user", "content": "hang"}], "n": 2, "stream": True}
            async with session.post(f"{url}/chat/completions", json=hanging) as open_stream:
                assert open_stream.status == 200
                await open_stream.content.readline()
                # 2 streams open: a request of 2 more would be 4, over 3; one more fits.
                status, answer = await _post(f"{url}/chat/completions", CHAT | {"n": 2})
                assert status == 429 and "--max-streams-per-caller" in answer["error"]["message"]
                status, _ = await _post(f"{url}/chat/completions", CHAT)
                assert status == 200
        await decoder.wait_until_none_open()


async def test_an_answer_being_written_holds_none_of_its_callers_streams() -> None:
    # Its n choices ended before its first byte: written while they still counted, an answer its caller
    # took slowly (here not at all: a window of a few KiB) kept the caller's n places until it was read,
    # and the caller's next request was refused 429 "streams are open" though the decoder had none.
    body = json.dumps({"prompt": "p", "n": 8, "max_tokens": 50, "logprobs": 20}).encode()
    async with (
        fake_decoder() as (decoder, address),
        live_gateway(address, send_buffer_bytes=4096, max_streams_per_caller=8) as url,
    ):
        sock = await connect(url, receive_buffer_bytes=4096)
        try:
            await send(sock, COMPLETIONS_HEAD + b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            async with asyncio.timeout(5):  # its head came: the answer is being written, its rest unread
                assert await asyncio.get_running_loop().sock_recv(sock, 1) == b"H"
            assert decoder.num_open == 0
            status, answer = await _post(f"{url}/completions", {"prompt": "q", "n": 8})
            assert status == 200 and len(answer["choices"]) == 8, answer
            status, stalled = await read_answer(sock, 5)  # and the slow one is whole
            assert status == 200 and len(json.dumps(stalled)) > 150_000  # twice the buffers between
            assert [len(c["logprobs"]["tokens"]) for c in stalled["choices"]] == [50] * 8
        finally:
            sock.close()


async def test_a_callers_answers_left_unread_are_at_most_as_many_choices_as_its_streams() -> None:
    # Written after its streams were given back, an answer no longer counted among them: a caller that
    # never read held up to --max-connections answers, each until --write-timeout-s (40 of 40 here).
    async with (
        fake_decoder() as (decoder, address),
        live_gateway(address, send_buffer_bytes=4096, max_streams_per_caller=8) as url,
    ):
        socks = [await unread_answer(url), await unread_answer(url)]  # 16 choices being written
        try:
            num_calls = len(decoder.requests)
            status, answer = await _post(f"{url}/completions", {"prompt": "q"})
            assert status == 429 and answer["error"]["type"] == "rate_limit_error", answer
            message = answer["error"]["message"]
            assert message.startswith("16 choices of this caller's answers are being written, unread, with 0")
            assert "over 16 (twice --max-streams-per-caller" in message, message
            assert len(decoder.requests) == num_calls  # refused before any call
            # A reset gives its choices back: the next request is served once the gateway has seen it.
            socks[1].setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            socks.pop().close()
            async with asyncio.timeout(5):
                while (status := (await _post(f"{url}/completions", {"prompt": "q", "n": 8}))[0]) == 429:
                    await asyncio.sleep(0.02)
            assert status == 200
            status, whole = await read_answer(socks[0], 5)  # and one read whole gives its choices back
            assert status == 200 and len(whole["choices"]) == 8
            socks.extend([await unread_answer(url)])  # 8 of 16 again, the read one's given back
            status, _ = await _post(f"{url}/completions", {"prompt": "q", "n": 8})
            assert status == 200
        finally:
            for sock in socks:
                sock.close()


async def _post_from(host: str, url: str, body: dict[str, Any]) -> tuple[int, Any]:
    """`_post` from `host`, another loopback address: another caller."""
    connector = aiohttp.TCPConnector(local_addr=(host, 0))
    async with (
        aiohttp.ClientSession(connector=connector) as session,
        session.post(url, json=body) as response,
    ):
        text = await response.text()
        return response.status, text if body.get("stream") else json.loads(text)


async def _given_back(url: str, host: str, body: dict[str, Any]) -> int:
    """`body`'s status from `host` once the gateway has seen a connection end (a moment after)."""
    async with asyncio.timeout(5):
        while (status := (await _post_from(host, url, body))[0]) in (429, 503):
            await asyncio.sleep(0.02)
    return status


# `unread_answer`'s request (8 choices of 50 tokens with 20 alternatives) reserves 413,668 bytes once
# decoded (`answer_bound`) and holds its JSON, 173,740 bytes, once serialized. A share of 500,000 holds
# one such answer, not a second beside it; 700,000 all callers together hold two, not three.
SHARES = {"max_unread_answer_bytes": 700_000, "max_unread_answer_bytes_per_caller": 500_000}
UNREAD = {"prompt": "p", "n": 8, "max_tokens": 50, "logprobs": 20}  # `unread_answer`'s body


async def _waits(asking: asyncio.Task[tuple[int, Any]], decoder: Any, num_calls: int) -> None:
    """`asking` was decoded (its calls made) and waits for its answer's bytes, unanswered."""
    async with asyncio.timeout(5):
        while len(decoder.requests) < num_calls + 8 or decoder.num_open:
            await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)
    assert not asking.done()


async def test_a_caller_over_its_share_waits_and_is_written_once_its_earlier_answer_is_read() -> None:
    # One caller trickling its answers (never past --write-timeout-s) held the whole gateway-wide bound;
    # refused at admission instead, its next request lost its place. Now it is decoded and waits.
    async with (
        fake_decoder() as (decoder, address),
        live_gateway(address, send_buffer_bytes=4096, **SHARES) as url,
    ):
        socks = [await unread_answer(url)]  # 173,740 bytes held by 127.0.0.1
        try:
            num_calls = len(decoder.requests)
            asking = asyncio.ensure_future(_post_from("127.0.0.1", f"{url}/completions", UNREAD))
            await _waits(asking, decoder, num_calls)
            status, answer = await read_answer(socks[0], 5)  # read whole: its bytes given back
            assert status == 200 and len(answer["choices"]) == 8
            status, answer = await asyncio.wait_for(asking, 5)
            assert status == 200 and [len(c["logprobs"]["tokens"]) for c in answer["choices"]] == [50] * 8
        finally:
            for sock in socks:
                sock.close()


async def test_a_neighbour_is_not_held_by_another_callers_unread_answers() -> None:
    async with (
        fake_decoder() as (decoder, address),
        live_gateway(address, send_buffer_bytes=4096, **SHARES) as url,
    ):
        socks = [await unread_answer(url)]  # 127.0.0.1's share held
        try:
            num_calls = len(decoder.requests)
            asking = asyncio.ensure_future(_post_from("127.0.0.1", f"{url}/completions", UNREAD))
            await _waits(asking, decoder, num_calls)  # and its next answer waits
            status, answer = await asyncio.wait_for(_post_from("127.0.0.2", f"{url}/completions", UNREAD), 5)
            assert status == 200 and len(answer["choices"]) == 8  # another caller: served at once
            assert not asking.done()
            asking.cancel()
        finally:
            for sock in socks:
                sock.close()


async def test_an_answer_over_the_gateways_bound_waits_for_another_callers_to_be_read() -> None:
    async with (
        fake_decoder() as (decoder, address),
        live_gateway(address, send_buffer_bytes=4096, **SHARES) as url,
    ):
        socks = [await unread_answer(url), await unread_answer(url, host="127.0.0.2")]  # 347,480 held
        try:
            num_calls = len(decoder.requests)
            asking = asyncio.ensure_future(_post_from("127.0.0.3", f"{url}/completions", UNREAD))
            await _waits(asking, decoder, num_calls)  # 347,480 + 413,668 over 700,000
            status, _ = await _post_from("127.0.0.3", f"{url}/completions", {"prompt": "q", "stream": True})
            assert status == 200  # a streamed answer holds none
            socks[0].setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            socks.pop(0).close()  # a reset gives the first caller's bytes back
            status, answer = await asyncio.wait_for(asking, 5)
            assert status == 200 and len(answer["choices"]) == 8
        finally:
            for sock in socks:
                sock.close()


async def test_an_answer_over_the_gateways_bound_alone_is_413_at_once_and_its_caller_is_served_next() -> None:
    # Queued, it could be written only when no caller held anything: every caller's answers waited
    # behind it (a caller keeping its own answer unread made that --write-timeout-s).
    bounds = {"max_unread_answer_bytes": 300_000, "max_unread_answer_bytes_per_caller": 100_000}
    async with fake_decoder() as (_, address), live_gateway(address, write_timeout_s=30, **bounds) as url:
        status, refused = await asyncio.wait_for(_post(f"{url}/completions", UNREAD), 5)  # 413,668 bytes
        assert status == 413 and "over 300000 (--max-unread-answer-bytes," in refused["error"]["message"]
        status, answer = await asyncio.wait_for(_post(f"{url}/completions", {"prompt": "q", "n": 2}), 5)
        assert status == 200 and len(answer["choices"]) == 2


async def test_long_context_requests_without_max_tokens_are_bounded_by_streams_alone() -> None:
    # Reserved at admission from what the context leaves (max_tokens unset), a 128k-context gateway let
    # 21 such requests decode a caller, 4 with logprobs, none with 20 alternatives (413).
    body = {"prompt": "hang", "logprobs": 20}  # decodes until cancelled, no max_tokens
    async with (
        fake_decoder() as (decoder, address),
        live_gateway(address, max_streams_per_caller=32, **SHARES) as url,
    ):
        asking = [asyncio.ensure_future(_post(f"{url}/completions", body)) for _ in range(32)]
        try:
            async with asyncio.timeout(5):
                while decoder.num_open < 32:
                    await asyncio.sleep(0.01)
            status, refused = await _post(f"{url}/completions", body)
            assert status == 429 and "--max-streams-per-caller" in refused["error"]["message"], refused
        finally:
            for task in asking:
                task.cancel()
        await decoder.wait_until_none_open()


async def test_every_answers_bytes_are_given_back_once_it_is_written() -> None:
    # Left held, a caller's bytes pile up answer after answer: its third waits, a 429 after 1 s.
    bounds = {"max_unread_answer_bytes": 3000, "max_unread_answer_bytes_per_caller": 3000}
    async with fake_decoder() as (_, address), live_gateway(address, write_timeout_s=1, **bounds) as url:
        for _ in range(4):  # each reserves 2,426 bytes and holds 930: 3,356 if one were left held
            status, answer = await asyncio.wait_for(_post(f"{url}/completions", {"prompt": "q", "n": 8}), 0.9)
            assert status == 200 and len(answer["choices"]) == 8, answer


def _completions(num_choices: int) -> list[Completion]:
    completions = []
    for index in range(num_choices):
        completion = Completion("chat", "id", "model", index, created=1)
        for k in range(200):
            delta = decoder_pb2.TokenDelta(text="tok", token_ids=[k], logprobs=[-1.0])
            delta.top_logprobs.add(token_ids=[1, 2], logprobs=[-2.0, -3.0])
            completion.add(delta, with_logprobs=True)
        completion.finished = decoder_pb2.Finished(reason=decoder_pb2.FINISH_REASON_LENGTH)
        completions.append(completion)
    return completions


async def test_a_non_streamed_answer_cancelled_while_serialized_gives_its_bytes_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(choice_json, "SLICE_VALUES", 4)  # many slices: many awaits to be cancelled at
    held = AnswerBytes(max_bytes=10**7, max_bytes_per_caller=10**7)
    request = cast(web.Request, None)
    writing = asyncio.ensure_future(answers.write(request, _completions(2), True, held, "caller", 5))
    while not held.num_bytes:  # reserved, serializing: nothing prepared
        await asyncio.sleep(0)
    await asyncio.sleep(0)
    writing.cancel()  # the caller gone: aiohttp cancels the handler
    with pytest.raises(asyncio.CancelledError):
        await writing
    assert (held.num_bytes, held.per_caller) == (0, {})


async def test_a_non_streamed_answer_cancelled_while_waiting_holds_nothing_and_leaves_no_waiter() -> None:
    held = AnswerBytes(max_bytes=10**6, max_bytes_per_caller=10**6)  # the answer's bound (~60 KB) fits alone
    other = Reservation(held, "other")
    other.take(10**6 - 1000)
    request = cast(web.Request, None)
    writing = asyncio.ensure_future(answers.write(request, _completions(1), True, held, "caller", 5))
    while not held.waiters and not writing.done():
        await asyncio.sleep(0)
    writing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await writing
    assert (held.num_bytes, dict(held.per_caller), len(held.waiters)) == (
        10**6 - 1000,
        {"other": 10**6 - 1000},
        0,
    )


async def test_a_refused_prompt_fails_the_batch_naming_it_and_cancels_the_others() -> None:
    async with fake_decoder() as (decoder, address), live_gateway(address) as url:
        status, answer = await _post(f"{url}/completions", {"prompt": ["a hang", "b hang", "after2 refuse"]})
        assert status == 400
        assert answer["error"]["param"] == "prompt[2]" and answer["error"]["message"].startswith(
            "prompt[2]: "
        )
        await decoder.wait_until_none_open()
        assert len(decoder.cancelled) == 2  # both hanging prompts' streams, cancelled by the gateway
        status, answer = await _post(f"{url}/completions", {"prompt": [[1], [2, 3, 1000]], "stream": True})
        assert (status, answer["error"]["param"]) == (400, "prompt[1][2]")  # before the stream began


async def test_a_single_prompts_bad_token_id_is_named_as_the_body_gave_it() -> None:
    async with fake_decoder() as (_, address), live_gateway(address) as url:
        for prompt, param in (
            ([1, 2, 1000], "prompt[2]"),  # a list of IDs: ID 2 of the prompt
            (["a", [5, 1000]], "prompt[1][1]"),  # a list of parts: ID 1 of part 1
            ([[5, 6, 1000]], "prompt[0][2]"),  # a list of one part
        ):
            for stream in (False, True):
                status, answer = await _post(f"{url}/completions", {"prompt": prompt, "stream": stream})
                assert (status, answer["error"]["param"]) == (400, param), (prompt, answer)
                assert answer["error"]["message"].startswith(f"{param}: ")


async def test_a_choice_failing_mid_stream_ends_the_stream_with_its_error_and_cancels_the_others() -> None:
    async with fake_decoder() as (decoder, address), live_gateway(address) as url:
        status, events = await _post(f"{url}/completions", {"prompt": ["hang", "break"], "stream": True})
        await decoder.wait_until_none_open()
    assert status == 200
    assert events[-2]["error"]["param"] == "prompt[1]" and events[-1] == "[DONE]"
    assert len(decoder.cancelled) == 1


async def test_a_caller_that_disconnects_mid_stream_cancels_every_choice() -> None:
    async with fake_decoder() as (decoder, address), live_gateway(address) as url:
        body = {"prompt": "hang", "n": 3, "stream": True}
        async with aiohttp.ClientSession() as session:
            response = await session.post(f"{url}/completions", json=body)
            assert response.status == 200
            await response.content.readline()
            assert decoder.num_open == 3
            response.close()  # the connection goes: the gateway's handler is cancelled
        await decoder.wait_until_none_open()
        assert len(decoder.cancelled) == 3


async def test_a_drained_choice_answers_503() -> None:
    async with fake_decoder() as (_, address), live_gateway(address) as url:
        status, answer = await _post(f"{url}/completions", {"prompt": ["a", "drain"]})
    assert status == 503 and answer["error"]["type"] == "service_unavailable"


async def test_an_error_on_max_completion_tokens_names_max_completion_tokens() -> None:
    async with fake_decoder() as (_, address), live_gateway(address) as url:
        status, sent = await _post(f"{url}/chat/completions", CHAT | {"max_completion_tokens": 60})
        _, legacy = await _post(f"{url}/chat/completions", CHAT | {"max_tokens": 60})
        _, batch = await _post(f"{url}/completions", {"prompt": ["a", "b"], "max_tokens": 60})
    assert status == 400
    assert sent["error"]["param"] == "max_completion_tokens"
    assert sent["error"]["message"].startswith("max_completion_tokens: ")
    assert legacy["error"]["param"] == "max_tokens"
    assert batch["error"]["param"] == "max_tokens" and "prompt[0]" in batch["error"]["message"]


async def test_n_copies_of_a_large_prompt_are_bounded_together_naming_n() -> None:
    prompt = "a" * 600  # one Generate call of about 600 bytes: within 1,024, but not three of them
    async with fake_decoder() as (decoder, address), live_gateway(address, max_message_bytes=1024) as url:
        status, answer = await _post(f"{url}/completions", {"prompt": prompt, "n": 3})
        assert (status, answer["error"]["param"]) == (413, "n"), answer
        assert decoder.requests == []
        status, _ = await _post(f"{url}/completions", {"prompt": prompt})
        assert status == 200


async def test_a_non_streamed_answer_lets_the_event_loop_go_between_its_choices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Rendered and dumped whole on the loop, 16 choices of 8,192 tokens with 20 alternatives held it,
    # /health and every other caller's stream, for 4 s (816 MB of entries, 191 MiB of JSON).
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    rendered = []
    choice = Completion.choice
    monkeypatch.setattr(
        Completion, "choice", lambda self, *args, **kw: rendered.append(ticks) or choice(self, *args, **kw)
    )
    body = CHAT | {"n": 3, "logprobs": True, "top_logprobs": 2, "max_tokens": 3}
    async with fake_decoder() as (_, address), live_gateway(address) as url:
        ticking = asyncio.ensure_future(ticker())
        try:
            status, answer = await _post(f"{url}/chat/completions", body)
        finally:
            ticking.cancel()
    assert status == 200 and [len(c["logprobs"]["content"]) for c in answer["choices"]] == [3, 3, 3]
    assert len(rendered) == 3 and rendered[0] < rendered[1] < rendered[2]  # the loop ran between them
