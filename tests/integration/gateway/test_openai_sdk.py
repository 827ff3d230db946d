"""The real `openai` SDK against a live gateway, decoder and encoder: what any OpenAI client does."""

from __future__ import annotations

import base64

import numpy as np
import openai
import pytest
import torch

from tandem.client.pb.tandem.v1 import decoder_pb2, encoder_pb2, tensor_pb2
from tests.integration.gateway.conftest import Live

pytestmark = pytest.mark.asyncio
PROMPT = "Once upon a time"


def _client(live: Live, **kwargs) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=live.base_url, api_key=kwargs.pop("api_key", "none"), max_retries=0, **kwargs
    )


async def _grpc_tokens(live: Live, request: decoder_pb2.GenerateRequest) -> tuple[str, decoder_pb2.Finished]:
    return await live.decoder.client._collect(live.decoder.client.generate(request))


async def test_models_lists_the_served_model(live: Live) -> None:
    async with _client(live) as client:
        models = await client.models.list()
        served = (await live.decoder.client.model_info()).model
        assert [m.id for m in models.data] == [served]
        assert (await client.models.retrieve(served)).id == served
        with pytest.raises(openai.NotFoundError) as missing:
            await client.models.retrieve("gpt-4o")
    assert missing.value.code == "model_not_found" and missing.value.param == "model"


async def test_a_chat_answer_is_the_decoders_own(live: Live) -> None:
    request = decoder_pb2.GenerateRequest(stopping=decoder_pb2.StoppingCriteria(max_new_tokens=12))
    request.sampling.temperature = 0
    request.chat.messages.add(role="user").content.add(text=PROMPT)
    expected, finished = await _grpc_tokens(live, request)
    async with _client(live) as client:
        reply = await client.chat.completions.create(
            model="", messages=[{"role": "user", "content": PROMPT}], max_tokens=12, temperature=0
        )
        streamed = await client.chat.completions.create(
            model="",
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in streamed]
    assert reply.choices[0].message.content == expected
    assert reply.choices[0].finish_reason in ("length", "stop")
    assert reply.usage.completion_tokens == finished.usage.output_tokens
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == finished.usage.output_tokens


async def test_completions_streamed_and_not_with_stop_strings_and_a_seed(live: Live) -> None:
    async with _client(live) as client:
        sampled = [
            (await client.completions.create(model="", prompt=PROMPT, max_tokens=16, seed=7, temperature=1.0))
            .choices[0]
            .text
            for _ in range(2)
        ]
        assert sampled[0] == sampled[1]  # same seed, same text
        stream = await client.completions.create(
            model="", prompt=PROMPT, max_tokens=16, temperature=0, stream=True
        )
        streamed = "".join([c.choices[0].text async for c in stream if c.choices])
        whole = await client.completions.create(model="", prompt=PROMPT, max_tokens=16, temperature=0)
        assert streamed == whole.choices[0].text
        stop = whole.choices[0].text[3:6]
        cut = await client.completions.create(
            model="", prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop]
        )
    assert cut.choices[0].finish_reason == "stop" and stop not in cut.choices[0].text


async def test_logprobs_are_the_decoders(live: Live) -> None:
    async with _client(live) as client:
        reply = await client.chat.completions.create(
            model="",
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=4,
            temperature=0,
            logprobs=True,
            top_logprobs=3,
        )
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy: the best one
        # Each token and alternative spelled by its own bytes, never `token_id:N`.
        assert (entry.token, entry.bytes) == (entry.top_logprobs[0].token, entry.top_logprobs[0].bytes)
        assert entry.token == bytes(entry.bytes).decode(errors="replace")
    joined = bytes(byte for entry in content for byte in entry.bytes or [])
    assert joined.decode(errors="replace") == reply.choices[0].message.content


async def test_embeddings_come_from_the_encoder(live: Live) -> None:
    async with _client(live) as client:
        reply = await client.embeddings.create(model="", input=["hello there", "general kenobi"])
        raw = await client.embeddings.create(model="", input="hello there", encoding_format="base64")
    assert len(reply.data) == 2 and len(reply.data[0].embedding) == 64
    ours = await live.encoder.stub.Embed(
        encoder_pb2.EmbedRequest(
            text="hello there", pooling=encoder_pb2.POOLING_MEAN, output_dtype=tensor_pb2.DATA_TYPE_FLOAT32
        )
    )
    expected = np.frombuffer(ours.embeddings.data, dtype="<f4")
    np.testing.assert_allclose(reply.data[0].embedding, expected, rtol=0, atol=0)
    assert reply.usage.prompt_tokens > 0
    as_floats = np.frombuffer(base64.b64decode(raw.data[0].embedding), dtype="<f4")  # OpenAI's base64
    np.testing.assert_array_equal(as_floats, expected)


async def test_an_embeddings_error_names_the_input_that_failed(live: Live) -> None:
    async with _client(live) as client:
        for body_input, param in (
            (["fine text", ""], "input[1]"),
            ([[1], [2], [99_999_999]], "input[2][0]"),
            ("", "input"),
        ):
            with pytest.raises(openai.BadRequestError) as refused:
                await client.embeddings.create(model="", input=body_input)  # type: ignore[arg-type]
            assert refused.value.param == param, refused.value.message
            assert refused.value.message.startswith(f"Error code: 400 - {param}")


async def test_a_completions_bad_token_id_names_it_as_the_body_gave_the_prompt(live: Live) -> None:
    async with _client(live) as client:
        for prompt, param in (
            ([1, 2, 99_999_999], "prompt[2]"),
            (["fine text", [3, 99_999_999]], "prompt[1][1]"),
            ([[5, 99_999_999]], "prompt[0][1]"),
            ([[1], [2, 99_999_999]], "prompt[1][1]"),  # a batch, as before
        ):
            with pytest.raises(openai.BadRequestError) as refused:
                await client.completions.create(model="", prompt=prompt, max_tokens=4)  # type: ignore[arg-type]
            assert refused.value.param == param, refused.value.message
            assert refused.value.message.startswith(f"Error code: 400 - {param}")


async def test_an_embedding_part_answers_as_its_tokens_do(live: Live, tiny_fp32) -> None:
    ids = tiny_fp32.tokenizer.encode(PROMPT).ids
    rows = tiny_fp32.model.embed_tokens.weight[torch.tensor(ids)].detach().float().numpy()
    part = {
        "type": "tandem_embeddings",
        "embeddings": {
            "dtype": "float32",
            "shape": list(rows.shape),
            "data": base64.b64encode(rows.tobytes()).decode(),
        },
    }
    async with _client(live) as client:
        as_text = await client.completions.create(model="", prompt=PROMPT, max_tokens=8, temperature=0)
        as_rows = await client.completions.create(model="", prompt=[part], max_tokens=8, temperature=0)  # type: ignore[list-item]
    assert as_rows.choices[0].text == as_text.choices[0].text


@pytest.mark.parametrize(
    ("kwargs", "status", "param"),
    [
        (dict(messages=[{"role": "wizard", "content": "hi"}]), 400, "messages[0].role"),
        # n choices are n streams: more than the fixture's --max-streams-per-caller 4 is refused by name
        (dict(messages=[{"role": "user", "content": "hi"}], n=5), 400, "n"),
        (dict(messages=[{"role": "user", "content": "hi"}], max_tokens=10**6), 400, "max_tokens"),
        (dict(messages=[{"role": "user", "content": "hi"}], model="gpt-4"), 404, None),
        (
            dict(
                messages=[
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "tandem_embeddings",
                                "embeddings": {
                                    "dtype": "float32",
                                    "shape": [1, 3],
                                    "data": "AAAAAAAAAAAAAAAA",
                                },
                            }
                        ],
                    }
                ]
            ),
            400,
            "messages[0].content[0].embeddings",
        ),
    ],
)
async def test_errors_come_in_openais_shape_with_the_right_status(
    live: Live, kwargs, status: int, param
) -> None:
    kwargs.setdefault("model", "")
    async with _client(live) as client:
        with pytest.raises(openai.APIStatusError) as error:
            await client.chat.completions.create(**kwargs)
    assert error.value.status_code == status, error.value.message
    body = error.value.body
    assert body["message"] and body["type"]
    if param is not None:
        assert body["param"] is not None and body["param"].startswith(param), body


async def test_a_caller_that_disconnects_mid_stream_frees_its_request(live: Live) -> None:
    import asyncio

    async with _client(live) as client:
        stream = await client.chat.completions.create(
            model="",
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=4000,
            temperature=0,
            stream=True,
        )
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == 3:
                break
        await stream.close()
    core = live.decoder.engine.core
    blocks = core.block_manager
    for _ in range(200):
        if core.num_live() == 0 and blocks.num_free_blocks == blocks.num_total_blocks:
            break
        await asyncio.sleep(0.05)
    assert core.num_live() == 0 and blocks.num_free_blocks == blocks.num_total_blocks


@pytest.mark.parametrize(
    ("name", "value", "temperature"),
    [("top_k", 1, 1.0), ("min_p", 1.0, 1.0), ("repetition_penalty", 2.0, 0.0)],  # greedy repeats itself
)
async def test_vllms_extra_parameters_reach_the_decoder(
    live: Live, name: str, value: float, temperature: float
) -> None:
    """Each of vLLM's extras changes the answer, to exactly the decoder's own answer with that value."""
    request = decoder_pb2.GenerateRequest(plain_text=True, prompt=[decoder_pb2.PromptSegment(text=PROMPT)])
    request.sampling.temperature, request.sampling.seed = temperature, 3
    request.stopping.max_new_tokens, request.stopping.ignore_eos = 40, True
    setattr(request.sampling, name, value)
    expected, _ = await _grpc_tokens(live, request)
    sampled = dict(model="", prompt=PROMPT, max_tokens=40, temperature=temperature, seed=3)
    async with _client(live) as client:
        given = await client.completions.create(**sampled, extra_body={"ignore_eos": True, name: value})
        without = await client.completions.create(**sampled, extra_body={"ignore_eos": True})
    assert given.choices[0].text == expected
    assert without.choices[0].text != expected  # the parameter matters here: dropping it would show
    assert given.usage.completion_tokens == 40 and given.choices[0].finish_reason == "length"


async def test_response_format_json_schema_gives_json_the_schema_validates(live: Live) -> None:
    import json

    import jsonschema

    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 10}, "rank": {"enum": [1, 2, 3]}},
        "required": ["city", "rank"],
        "additionalProperties": False,
    }
    async with _client(live) as client:
        reply = await client.chat.completions.create(
            model="", messages=[{"role": "user", "content": PROMPT}], temperature=0, max_tokens=64,
            response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
        )  # fmt: skip
        assert reply.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
        choice = await client.completions.create(
            model="", prompt=PROMPT, max_tokens=8, extra_body={"guided_choice": ["up", "down"]}
        )
        assert choice.choices[0].text in ("up", "down")
        with pytest.raises(openai.BadRequestError) as error:
            await client.completions.create(
                model="", prompt=PROMPT, extra_body={"guided_regex": "a+", "guided_choice": ["x"]}
            )
        assert error.value.body["param"] == "guided_choice"
        for name, source in (("guided_regex", "(("), ("guided_grammar", "start: (")):
            with pytest.raises(openai.BadRequestError) as error:
                await client.completions.create(model="", prompt=PROMPT, extra_body={name: source})
            assert error.value.body["param"] == name  # the caller's own field, in the message too
            assert error.value.body["message"].startswith(f"{name}: does not compile")
        with pytest.raises(openai.BadRequestError) as error:
            await client.chat.completions.create(
                model="", messages=[{"role": "user", "content": PROMPT}],
                response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}},
            )  # fmt: skip
        assert error.value.body["param"] == "response_format.json_schema.schema"


async def test_what_cannot_be_met_is_a_400_naming_it_never_an_answer_short_of_it(live: Live) -> None:
    """A min_tokens the context cannot hold beside the prompt is refused with max_tokens sent or not,
    as vLLM refuses it (cut to the room a chat without max_tokens has, it ran to the context's end and
    ended `length`); a structured_outputs constraint of false is refused naming it, as vLLM's types do
    (dropped, it answered free text)."""
    messages = [{"role": "user", "content": PROMPT}]
    async with _client(live) as client:
        for max_tokens, refusal in (
            ({}, "must be at most "),
            ({"max_tokens": 10}, "must be in [0, max_tokens=10]"),
        ):
            with pytest.raises(openai.BadRequestError) as error:
                await client.chat.completions.create(
                    model="", messages=messages, extra_body={"min_tokens": 100_000}, **max_tokens
                )
            assert error.value.body["param"] == "min_tokens", error.value.body
            assert error.value.body["message"].startswith(f"min_tokens: {refusal}"), error.value.body
        for key in ("json", "regex", "choice", "grammar"):
            with pytest.raises(openai.BadRequestError) as error:
                await client.chat.completions.create(
                    model="", messages=messages, max_tokens=4, extra_body={"structured_outputs": {key: False}}
                )
            assert error.value.body["param"] == f"structured_outputs.{key}", error.value.body


async def test_prompt_logprobs_are_the_decoders_own_in_vllms_shape(live: Live) -> None:
    """vLLM's extra `prompt_logprobs`: each completions choice holds the decoder's scores of its prompt
    (n choices, one Generate call of them asking), a chat answer its own; never dropped."""
    request = decoder_pb2.GenerateRequest(plain_text=True, prompt=[decoder_pb2.PromptSegment(text=PROMPT)])
    request.output.prompt_logprobs, request.stopping.max_new_tokens = 2, 1
    (scored,) = [r.delta async for r in live.decoder.client.generate(request) if r.delta.prompt_logprobs]
    expected: list[dict | None] = [None]
    for position in scored.prompt_logprobs[1:]:  # the prompt's token (its rank in the vocabulary), the top 2
        top = position.top_logprobs
        assert position.HasField("rank")
        own = (position.token_id, position.logprob, position.token_bytes, position.rank)
        alternatives = zip(top.token_ids, top.logprobs, top.token_bytes, (1, 2), strict=True)
        expected.append(
            {str(t): (lp, b.decode(errors="replace"), rank) for t, lp, b, rank in (own, *alternatives)}
        )
    body = {"prompt_logprobs": 2}
    async with _client(live) as client:
        reply = await client.completions.create(
            model="", prompt=PROMPT, max_tokens=1, temperature=0, n=2, extra_body=body
        )
        chat = await client.chat.completions.create(
            model="", messages=[{"role": "user", "content": PROMPT}], max_tokens=1, extra_body=body
        )
    for choice in reply.choices:
        given = choice.model_extra["prompt_logprobs"]
        assert len(given) == len(expected) == reply.usage.prompt_tokens
        assert given[0] is None
        for entries, wanted in zip(given[1:], expected[1:], strict=True):
            assert list(entries) == list(wanted)  # the prompt's token first, then the likeliest two
            for key, (lp, text, rank) in wanted.items():
                assert entries[key]["logprob"] == pytest.approx(lp, abs=1e-5)
                assert (entries[key]["decoded_token"], entries[key]["rank"]) == (text, rank)
    chat_scores = chat.model_extra["prompt_logprobs"]
    assert len(chat_scores) == chat.usage.prompt_tokens and chat_scores[0] is None
    assert all(len(entries) in (2, 3) for entries in chat_scores[1:])
