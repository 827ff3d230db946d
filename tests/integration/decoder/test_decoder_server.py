"""tandem.v1.Decoder over real gRPC: streams, validation, cancellation, limits, health."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_status import rpc_status

from tandem.client.pb.tandem.v1 import decoder_pb2, tensor_pb2
from tandem.common.torch_part import tensors
from tandem.decoder.engine.admission.prompt import EmbeddingPrompt, GenerateSpec, TextPrompt
from tandem.decoder.engine.outputs.outputs import Delta
from tandem.decoder.engine.params import SamplingParams, StoppingParams

from .conftest import Served, serve, shutdown


async def _collect(call) -> list[decoder_pb2.GenerateResponse]:
    """The rest of a stream (read() style, so it may follow earlier read() calls)."""
    responses = []
    while (response := await call.read()) is not grpc.aio.EOF:
        responses.append(response)
    return responses


def _tokens(responses) -> list[int]:
    return [t for r in responses if r.HasField("delta") for t in r.delta.token_ids]


async def test_streamed_generation_equals_the_in_process_engine(decoder: Served) -> None:
    responses = await _collect(
        decoder.client.generate(["Once upon a time"], max_new_tokens=12, temperature=0.0)
    )
    assert responses[0].HasField("accepted")
    assert responses[-1].HasField("finished")
    assert all(r.HasField("delta") for r in responses[1:-1])
    spec = GenerateSpec(
        [TextPrompt("Once upon a time")], SamplingParams(temperature=0.0), StoppingParams(max_new_tokens=12)
    )
    expected = [t for e in decoder.engine.generate(spec) if isinstance(e, Delta) for t in e.token_ids]
    assert _tokens(responses) == expected
    finished = responses[-1].finished
    assert finished.usage.output_tokens == len(expected)
    assert finished.usage.input_tokens == responses[0].accepted.prompt_tokens
    assert finished.total_time_s >= finished.time_to_first_token_s > 0


async def test_a_speculating_request_streams_the_tokens_of_a_plain_one_and_reports_its_proposals(
    decoder: Served,
) -> None:
    # A prompt on which the tiny model's greedy output repeats itself, so prompt lookup proposes.
    prompt = [torch.randint(5, 1000, (8,), generator=torch.Generator().manual_seed(0)).tolist()]
    options = dict(max_new_tokens=64, temperature=0.0, ignore_eos=True)
    plain = await _collect(decoder.client.generate(prompt, **options))
    speculated = await _collect(decoder.client.generate(prompt, speculative_tokens=4, **options))
    assert _tokens(speculated) == _tokens(plain)
    assert (plain[-1].finished.proposed_tokens, plain[-1].finished.accepted_tokens) == (0, 0)
    finished = speculated[-1].finished
    assert finished.proposed_tokens >= finished.accepted_tokens >= 1
    assert finished.usage.output_tokens == 64


async def test_64_concurrent_streams_finish_with_their_token_counts(decoder: Served) -> None:
    hidden = decoder.engine.model_config.hidden_size

    async def one(i: int):
        prompt: list = [[10 + i, 11, 12]]
        if i % 3 == 1:
            prompt.append(tensors.encode(torch.randn(2, hidden), dtype=torch.bfloat16))
        if i % 3 == 2:
            prompt.append("the sea")
        return await _collect(
            decoder.client.generate(
                prompt,
                max_new_tokens=4 + i % 7,
                temperature=0.0 if i % 2 else 0.8,
                seed=i,
                ignore_eos=True,
                timeout=120,
            )
        )

    results = await asyncio.gather(*(one(i) for i in range(64)))
    for i, responses in enumerate(results):
        assert len(_tokens(responses)) == 4 + i % 7
        assert responses[-1].finished.reason == decoder_pb2.FINISH_REASON_LENGTH


async def test_a_mixed_prompt_is_scored_once_on_the_first_delta_with_its_embedding_rows_marked(
    decoder: Served,
) -> None:
    rows = torch.randn(3, decoder.engine.model_config.hidden_size, generator=torch.Generator().manual_seed(2))
    responses = await _collect(
        decoder.client.generate(
            [[10, 11], tensors.encode(rows), "the sea"],
            max_new_tokens=4,
            temperature=0.0,
            ignore_eos=True,
            prompt_logprobs=4,
        )
    )
    deltas = [r.delta for r in responses if r.HasField("delta")]
    entries = deltas[0].prompt_logprobs
    assert len(entries) == responses[0].accepted.prompt_tokens > 5
    assert not any(d.prompt_logprobs for d in deltas[1:])
    assert entries[0].token_id == 10 and not entries[0].HasField("logprob")  # position 0: no context
    assert not entries[0].HasField("top_logprobs")
    for row in entries[2:5]:  # embedding rows: no token, but what the model predicted there
        assert not row.HasField("token_id") and not row.HasField("logprob")
        assert len(row.top_logprobs.token_ids) == 4
    for token in [entries[1], *entries[5:]]:
        assert token.HasField("token_id") and token.logprob <= 0 and len(token.top_logprobs.logprobs) == 4
    spec = GenerateSpec(
        [[10, 11], EmbeddingPrompt(rows), TextPrompt("the sea")],
        SamplingParams(temperature=0.0, prompt_logprobs=4),
        StoppingParams(max_new_tokens=4, ignore_eos=True),
    )
    in_process = next(e for e in decoder.engine.generate(spec) if isinstance(e, Delta)).prompt_logprobs
    assert [e.token_id if e.HasField("token_id") else None for e in entries] == [
        e.token_id for e in in_process
    ]
    assert [e.logprob for e in entries[5:]] == pytest.approx([e.logprob for e in in_process[5:]], rel=1e-6)


def _embeddings(shape, dtype=tensor_pb2.DATA_TYPE_FLOAT32, data=None) -> decoder_pb2.PromptSegment:
    n = 1
    for d in shape:
        n *= d
    return decoder_pb2.PromptSegment(
        embeddings=tensor_pb2.Tensor(dtype=dtype, shape=shape, data=bytes(4 * n) if data is None else data)
    )


def _bad_requests(hidden: int, vocab: int, max_len: int) -> list[tuple[str, decoder_pb2.GenerateRequest]]:
    def req(*segments, **fields) -> decoder_pb2.GenerateRequest:
        r = decoder_pb2.GenerateRequest(prompt=list(segments) or [decoder_pb2.PromptSegment(text="hi")])
        for path, value in fields.items():
            message, name = path.split("__")
            setattr(getattr(r, message), name, value)
        return r

    nan = tensors.encode(torch.full((1, hidden), float("nan"))).data
    return [
        ("prompt", decoder_pb2.GenerateRequest()),
        ("prompt[0].embeddings.shape", req(_embeddings([2, hidden + 1]))),
        ("prompt[0].embeddings.shape", req(_embeddings([2, 1, hidden]))),
        ("prompt[0].embeddings.dtype", req(_embeddings([1, hidden], dtype=77))),
        ("prompt[0].embeddings.data", req(_embeddings([2, hidden], data=b"\0" * 12))),
        ("prompt[0].embeddings.data", req(_embeddings([1, hidden], data=nan))),
        ("prompt[0].embeddings.dtype", req(decoder_pb2.PromptSegment(embeddings=tensor_pb2.Tensor()))),
        ("prompt[0].embeddings.shape", req(_embeddings([0, hidden], data=b""))),
        ("prompt[0].embeddings.shape", req(_embeddings([-1, hidden], data=b""))),
        ("prompt[0].embeddings.shape", req(_embeddings([1 << 40, hidden], data=b"\0" * 8))),
        ("prompt[0].embeddings.shape", req(_embeddings([1] * 100_000 + [hidden]))),  # counted, not read
        ("prompt[0]", req(decoder_pb2.PromptSegment())),
        (
            "prompt[0].token_ids.ids[0]",
            req(decoder_pb2.PromptSegment(token_ids=tensor_pb2.TokenIds(ids=[2**32 - 1]))),
        ),
        (
            "prompt[1].token_ids.ids[1]",
            req(
                decoder_pb2.PromptSegment(text="a"),
                decoder_pb2.PromptSegment(token_ids=tensor_pb2.TokenIds(ids=[1, vocab])),
            ),
        ),
        ("prompt[0].text", req(decoder_pb2.PromptSegment(text=""))),
        ("prompt", req(decoder_pb2.PromptSegment(token_ids=tensor_pb2.TokenIds(ids=[1] * max_len)))),
        ("stopping.max_new_tokens", req(stopping__max_new_tokens=max_len)),
        ("sampling.temperature", req(sampling__temperature=-1.0)),
        ("sampling.top_p", req(sampling__top_p=1.5)),
        ("sampling.min_p", req(sampling__min_p=2.0)),
        ("output.top_logprobs", req(output__top_logprobs=99)),
        ("output.prompt_logprobs", req(output__prompt_logprobs=21)),
        ("stopping.stop_sequences", req_with_stops(17)),
        (
            "speculative_tokens",
            decoder_pb2.GenerateRequest(prompt=[decoder_pb2.PromptSegment(text="hi")], speculative_tokens=17),
        ),
        # A request ID is logged as sent: no forged line, no twin that differs in white space, bounded.
        *(
            (
                "request_id",
                decoder_pb2.GenerateRequest(request_id=rid, prompt=[decoder_pb2.PromptSegment(text="hi")]),
            )
            for rid in ("r1\nINFO forged line", "r1\rx", "r1\x1b[2J", "r1\u2028x", "r1 ", " r1", "é" * 65)
        ),
    ]


def req_with_stops(n: int) -> decoder_pb2.GenerateRequest:
    r = decoder_pb2.GenerateRequest(prompt=[decoder_pb2.PromptSegment(text="hi")])
    r.stopping.stop_sequences.extend(f"s{i}" for i in range(n))
    return r


async def test_each_bad_request_is_invalid_argument_naming_its_field(decoder: Served) -> None:
    c = decoder.engine.model_config
    blocks = decoder.engine.core.block_manager
    initial = blocks.num_free_blocks
    for field, request in _bad_requests(c.hidden_size, c.vocab_size, decoder.engine.max_model_len):
        call = decoder.client.generate(request, timeout=30)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await _collect(call)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, caught.value.details())
        status = await rpc_status.aio.from_call(call)
        violation = error_details_pb2.BadRequest()
        assert status.details[0].Unpack(violation)
        assert violation.field_violations[0].field == field
    # ... and the server still serves, with every KV block back once it is done.
    assert (
        len(_tokens(await _collect(decoder.client.generate([[5, 6]], max_new_tokens=3, ignore_eos=True))))
        == 3
    )
    for _ in range(100):
        if blocks.num_free_blocks == initial and decoder.engine.core.num_live() == 0:
            break
        await asyncio.sleep(0.02)
    assert (blocks.num_free_blocks, decoder.engine.core.num_live()) == (initial, 0)


async def test_embeddings_are_refused_when_disabled(tiny_model_dir, tiny_fp32) -> None:
    served = await serve(tiny_model_dir, tiny_fp32, enable_prompt_embeds=False)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await _collect(
                served.client.generate([tensors.encode(torch.zeros(1, tiny_fp32.config.hidden_size))])
            )
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        await shutdown(served)


async def test_cancel_mid_stream_returns_every_kv_block(decoder: Served) -> None:
    blocks = decoder.engine.core.block_manager
    initial = blocks.num_free_blocks
    call = decoder.client.generate([[1, 2, 3]], max_new_tokens=500, ignore_eos=True)
    assert (await call.read()).HasField("accepted")
    assert (await call.read()).HasField("delta")
    assert blocks.num_free_blocks < initial
    call.cancel()
    for _ in range(100):
        if blocks.num_free_blocks == initial and decoder.engine.core.num_live() == 0:
            break
        await asyncio.sleep(0.02)
    assert blocks.num_free_blocks == initial
    assert decoder.engine.core.num_live() == 0


async def test_queue_full_is_resource_exhausted_with_retry_info(tiny_model_dir, tiny_fp32) -> None:
    served = await serve(tiny_model_dir, tiny_fp32, max_num_seqs=1, max_queue=1)
    try:
        running = served.client.generate([[1, 2]], max_new_tokens=400, ignore_eos=True)
        await running.read()  # accepted
        assert (await running.read()).HasField("delta")  # running now: the queue is empty again
        waiting = served.client.generate([[3, 4]], max_new_tokens=2)
        await waiting.read()  # accepted: it waits in the queue
        refused = served.client.generate([[5, 6]], max_new_tokens=2)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await _collect(refused)
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        status = await rpc_status.aio.from_call(refused)
        retry = error_details_pb2.RetryInfo()
        assert status.details[0].Unpack(retry)
        running.cancel()
        assert _tokens(await _collect(waiting))
    finally:
        await shutdown(served)


async def test_deadline_passing_in_the_queue_ends_before_prefill(tiny_model_dir, tiny_fp32) -> None:
    served = await serve(tiny_model_dir, tiny_fp32, max_num_seqs=1)
    try:
        running = served.client.generate([[1, 2]], max_new_tokens=400, ignore_eos=True)
        await running.read()
        late = served.client.generate([[3, 4]], max_new_tokens=2, timeout=0.3)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await _collect(late)
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        running.cancel()
        for _ in range(100):
            if served.engine.core.num_live() == 0:
                break
            await asyncio.sleep(0.02)
        assert served.engine.core.num_live() == 0
    finally:
        await shutdown(served)


async def test_tokenize_and_model_info(decoder: Served) -> None:
    assert await decoder.client.tokenize(["hello world"]) == [
        decoder.engine.tokenizer.encode("hello world", add_special_tokens=False).ids
    ]
    info = await decoder.client.model_info()
    c = decoder.engine.model_config
    assert (info.hidden_size, info.vocab_size, info.architecture) == (
        c.hidden_size,
        c.vocab_size,
        "Qwen3ForCausalLM",
    )
    assert info.accepts_prompt_embeds
    assert list(info.eos_token_ids) == list(c.eos_token_ids)
    assert info.dtype == tensor_pb2.DATA_TYPE_FLOAT32


async def test_health_and_reflection(decoder: Served) -> None:
    assert await decoder.client.health("tandem.v1.Decoder") == health_pb2.HealthCheckResponse.SERVING
    stub = reflection_pb2_grpc.ServerReflectionStub(decoder.client.channel)
    call = stub.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
    )
    names = {s.name async for reply in call for s in reply.list_services_response.service}
    assert {"tandem.v1.Decoder", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names


async def test_an_engine_fault_ends_open_streams_with_unavailable_and_never_hangs(
    tiny_model_dir, tiny_fp32
) -> None:
    served = await serve(tiny_model_dir, tiny_fp32)
    try:
        execute = served.engine.core.runner.execute
        calls = 0

        def failing(plan):
            nonlocal calls
            calls += 1
            if calls > 3:
                raise RuntimeError("simulated device fault")
            return execute(plan)

        served.engine.core.runner.execute = failing
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await _collect(
                served.client.generate([[1, 2, 3]], max_new_tokens=50, ignore_eos=True, timeout=30)
            )
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert not served.engine.is_healthy
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await _collect(served.client.generate([[1, 2, 3]], max_new_tokens=5, timeout=30))
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await shutdown(served)


async def test_the_context_is_what_the_kv_pool_holds_and_a_default_length_fits_it(
    tiny_model_dir, tiny_fp32
) -> None:
    # 40 blocks of 4, one reserved: 156 positions, far below the checkpoint's 4,096. The pool's bound
    # is the context that GetModelInfo says and that a default max_new_tokens is capped to; a request
    # that set no length was refused for max_new_tokens, a field it never sent.
    served = await serve(tiny_model_dir, tiny_fp32, num_kv_blocks=40)
    try:
        assert (await served.client.model_info()).max_context_tokens == 39 * 4
        prompt = list(range(1, 151))
        request = decoder_pb2.GenerateRequest(prompt=[decoder_pb2.PromptSegment(token_ids={"ids": prompt})])
        request.stopping.ignore_eos = True
        text, finished = await served.client._collect(served.client.generate(request))
        assert finished.usage.output_tokens == 156 - 150  # the default 256, capped to the pool
        request.prompt[0].token_ids.ids.extend(range(1, 7))  # 156 positions: none left to generate
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await served.client._collect(served.client.generate(request))
        assert "exceed the 155 a prompt may take (max_model_len 156" in error.value.details()
    finally:
        await shutdown(served)
