"""Tracing and metrics end to end: a client, an encoder and a decoder, in process on loopback, each
with its own providers over in-memory exporters, as three processes would have."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from tandem.client import telemetry as otel
from tandem.client.client import DecoderClient, EncoderClient, prompt_segments
from tandem.client.pb.tandem.v1 import decoder_pb2, decoder_pb2_grpc
from tandem.common.server import RunningServer, ServerOptions, Service, start_server
from tandem.decoder.api.servicer import DecoderServicer
from tandem.decoder.config import EngineConfig
from tandem.decoder.engine.front.engine import Engine
from tandem.decoder.models.loader import LoadedModel
from tandem.encoder.config import EncoderConfig
from tandem.encoder.lookup import LookupEmbedder
from tandem.encoder.servicer import EncoderServicer

MAX_MESSAGE_BYTES = 4 * 1024 * 1024
MODEL = "tiny"
TEXT_COMPLETION = f"text_completion {MODEL}"
EMBEDDINGS = f"embeddings {MODEL}"


@pytest.fixture(scope="module")
def lookup(tiny_model_dir: Path) -> LookupEmbedder:
    return LookupEmbedder.load(tiny_model_dir, torch.float32)


@dataclass
class Stack:
    client_telemetry: otel.Telemetry
    engine: Engine
    encoder: EncoderClient
    decoder: DecoderClient
    servers: list[RunningServer]
    encoder_servicer: EncoderServicer


async def start_stack(
    model_dir: Path, loaded: LoadedModel, lookup: LookupEmbedder, make: Callable[[str], otel.Telemetry]
) -> Stack:
    client_t, encoder_t, decoder_t = make("test-client"), make("tandem-encoder"), make("tandem-decoder")
    # A 4-token step budget: prompts are prefilled in several chunks, each one a span event.
    engine = Engine(
        EngineConfig(
            model_dir=model_dir, dtype="float32", num_kv_blocks=1100, block_size=4, max_num_batched_tokens=4
        ),
        loaded,
    ).start()
    decoder_server = await start_server(
        ServerOptions(
            port=0, max_message_bytes=MAX_MESSAGE_BYTES, interceptors=decoder_t.server_interceptors()
        ),
        [
            Service(
                "tandem.v1.Decoder",
                DecoderServicer(MODEL, MAX_MESSAGE_BYTES, engine=engine, telemetry=decoder_t),
                decoder_pb2_grpc.add_DecoderServicer_to_server,
            )
        ],
    )
    encoder_config = EncoderConfig(
        model_dir=model_dir,
        model_name=MODEL,
        dtype="float32",
        server=ServerOptions(
            port=0, max_message_bytes=MAX_MESSAGE_BYTES, interceptors=encoder_t.server_interceptors()
        ),
    )
    encoder_servicer = EncoderServicer(encoder_config, telemetry=encoder_t)
    encoder_servicer.attach(lookup)
    encoder_server = await start_server(
        encoder_config.server,
        [encoder_servicer.service()],
    )
    for server in (decoder_server, encoder_server):
        await server.set_serving()
    return Stack(
        client_telemetry=client_t,
        engine=engine,
        encoder=EncoderClient(encoder_server.address, MAX_MESSAGE_BYTES, telemetry=client_t),
        decoder=DecoderClient(decoder_server.address, MAX_MESSAGE_BYTES, telemetry=client_t),
        servers=[decoder_server, encoder_server],
        encoder_servicer=encoder_servicer,
    )


async def stop_stack(stack: Stack) -> None:
    await stack.encoder.close()
    await stack.decoder.close()
    for server in stack.servers:
        await server.stop(0)
    stack.engine.shutdown()
    stack.encoder_servicer.close()


@dataclass
class Traced:
    stack: Stack
    spans: InMemorySpanExporter  # every process's spans
    client_metrics: InMemoryMetricReader
    decoder_metrics: InMemoryMetricReader


@pytest.fixture
async def traced(
    tiny_model_dir: Path, tiny_fp32: LoadedModel, lookup: LookupEmbedder
) -> AsyncIterator[Traced]:
    exporter = InMemorySpanExporter()
    readers: dict[str, InMemoryMetricReader] = {}

    def make(service: str) -> otel.Telemetry:
        readers[service] = InMemoryMetricReader()
        return otel.build_telemetry(service, [SimpleSpanProcessor(exporter)], [readers[service]])

    stack = await start_stack(tiny_model_dir, tiny_fp32, lookup, make)
    yield Traced(stack, exporter, readers["test-client"], readers["tandem-decoder"])
    await stop_stack(stack)


async def wait_for(condition: Callable[[], object], timeout_s: float = 5.0) -> None:
    """Server spans end just after the client sees the status: poll rather than race them."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


def named(spans: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [s for s in spans.get_finished_spans() if s.name == name]


def decoder_generate(spans: InMemorySpanExporter) -> list[ReadableSpan]:
    """The decoder's gRPC server spans of Generate calls."""
    return [s for s in named(spans, "/tandem.v1.Decoder/Generate") if s.kind is SpanKind.SERVER]


def points(reader: InMemoryMetricReader, name: str) -> list:
    data = reader.get_metrics_data()
    found = []
    for resource_metrics in data.resource_metrics if data else []:
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                if metric.name == name:
                    found.extend(metric.data.data_points)
    return found


def generate_request(prompt: list, max_new_tokens: int, **sampling: float) -> decoder_pb2.GenerateRequest:
    request = decoder_pb2.GenerateRequest(prompt=prompt_segments(prompt))
    request.stopping.max_new_tokens = max_new_tokens
    request.stopping.ignore_eos = True
    for name, value in sampling.items():
        setattr(request.sampling, name, value)
    return request


async def test_one_generation_is_one_trace_across_client_encoder_and_decoder(traced: Traced) -> None:
    stack = traced.stack
    (text_ids,) = await stack.decoder.tokenize(["the end"])
    request = generate_request([], 5, temperature=0.7, top_p=0.9, top_k=20, seed=3)
    with stack.client_telemetry.tracer.start_as_current_span("pipeline") as root:
        embedded = await stack.encoder.embed(text="hello world")
        num_rows = embedded.embeddings.shape[0]
        request.prompt.extend(prompt_segments([[1, 2, 3], embedded.embeddings, "the end"]))
        responses = [r async for r in stack.decoder.generate(request)]
    await stack.decoder.health()  # health checks are never traced
    await wait_for(
        lambda: named(traced.spans, TEXT_COMPLETION) and len(traced.spans.get_finished_spans()) >= 8
    )

    spans = traced.spans.get_finished_spans()
    assert {s.context.trace_id for s in spans if s.name != "/tandem.v1.Decoder/Tokenize"} == {
        root.get_span_context().trace_id
    }
    assert not [s for s in spans if "Health" in s.name]
    by_id = {s.context.span_id: s for s in spans}

    def parent(span: ReadableSpan) -> ReadableSpan:
        assert span.parent is not None
        return by_id[span.parent.span_id]

    (completion,) = named(traced.spans, TEXT_COMPLETION)
    (embedding,) = named(traced.spans, EMBEDDINGS)
    decoder_server = parent(completion)
    assert (decoder_server.name, decoder_server.kind) == ("/tandem.v1.Decoder/Generate", SpanKind.SERVER)
    assert decoder_server.resource.attributes["service.name"] == "tandem-decoder"
    # client: pipeline -> gen_ai span (`text_completion`, `embeddings`) -> gRPC span -> the server's
    generate_client = parent(decoder_server)
    assert (generate_client.name, generate_client.kind) == ("/tandem.v1.Decoder/Generate", SpanKind.CLIENT)
    client_completion = parent(generate_client)
    assert (client_completion.name, client_completion.kind) == ("text_completion", SpanKind.CLIENT)
    assert parent(client_completion).name == "pipeline"
    encoder_server = parent(embedding)
    assert (encoder_server.name, encoder_server.kind) == ("/tandem.v1.Encoder/Embed", SpanKind.SERVER)
    assert encoder_server.resource.attributes["service.name"] == "tandem-encoder"
    client_embedding = parent(parent(encoder_server))
    assert (client_embedding.name, client_embedding.kind) == ("embeddings", SpanKind.CLIENT)
    assert parent(client_embedding).name == "pipeline"

    accepted = responses[0].accepted
    finished = responses[-1].finished
    num_positions = 3 + num_rows + len(text_ids)
    assert accepted.prompt_tokens == finished.usage.input_tokens == num_positions
    a = completion.attributes
    assert a[otel.GEN_AI_OPERATION_NAME] == "text_completion" and a[otel.GEN_AI_PROVIDER_NAME] == "tandem"
    assert a[otel.GEN_AI_REQUEST_MODEL] == MODEL
    assert a[otel.GEN_AI_REQUEST_MAX_TOKENS] == 5
    assert a[otel.GEN_AI_REQUEST_TEMPERATURE] == pytest.approx(0.7)
    assert a[otel.GEN_AI_REQUEST_TOP_P] == pytest.approx(0.9)
    assert (a[otel.GEN_AI_REQUEST_TOP_K], a[otel.GEN_AI_REQUEST_SEED]) == (20, 3)
    assert a[otel.GEN_AI_RESPONSE_ID] == responses[0].request_id
    assert tuple(a[otel.GEN_AI_RESPONSE_FINISH_REASONS]) == ("length",)
    assert (a[otel.GEN_AI_USAGE_INPUT_TOKENS], a[otel.GEN_AI_USAGE_OUTPUT_TOKENS]) == (num_positions, 5)
    assert a[otel.TANDEM_PROMPT_EMBEDDING_POSITIONS] == num_rows
    assert a[otel.TANDEM_USAGE_CACHED_TOKENS] == finished.usage.cached_input_tokens
    assert a[otel.TANDEM_WORLD_SIZE] == 1
    assert otel.ERROR_TYPE not in a and completion.status.status_code is not StatusCode.ERROR
    # Time to first token is also on the span, as the server measured it (arrival to first token).
    assert a[otel.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK] == pytest.approx(finished.time_to_first_token_s)

    # The client's own span carries the gen_ai attributes as the client saw them.
    c = client_completion.attributes
    assert (c[otel.GEN_AI_OPERATION_NAME], c[otel.GEN_AI_PROVIDER_NAME]) == ("text_completion", "tandem")
    assert (c[otel.GEN_AI_REQUEST_MAX_TOKENS], c[otel.GEN_AI_REQUEST_TOP_K], c[otel.GEN_AI_REQUEST_SEED]) == (
        5,
        20,
        3,
    )
    assert c[otel.GEN_AI_REQUEST_TEMPERATURE] == pytest.approx(0.7)
    assert c[otel.GEN_AI_RESPONSE_ID] == responses[0].request_id
    assert tuple(c[otel.GEN_AI_RESPONSE_FINISH_REASONS]) == ("length",)
    assert (c[otel.GEN_AI_USAGE_INPUT_TOKENS], c[otel.GEN_AI_USAGE_OUTPUT_TOKENS]) == (num_positions, 5)
    client_ttft_s = c[otel.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK]
    assert 0 < client_ttft_s <= (client_completion.end_time - client_completion.start_time) / 1e9
    assert client_completion.status.status_code is not StatusCode.ERROR
    ce = client_embedding.attributes
    assert (ce[otel.GEN_AI_OPERATION_NAME], ce[otel.GEN_AI_USAGE_INPUT_TOKENS]) == ("embeddings", num_rows)
    assert ce[otel.GEN_AI_EMBEDDINGS_DIMENSION_COUNT] == 64

    # Engine work as events, none per decoded token; prefill chunks tile the uncached prompt in order.
    names = [e.name for e in completion.events]
    assert names[0] == "queued" and names[-2:] == ["first_token", "finished"]
    chunks = [e for e in completion.events if e.name == "prefill_chunk"]
    assert names == ["queued"] + ["prefill_chunk"] * len(chunks) + ["first_token", "finished"]
    assert len(chunks) == -(-(num_positions - finished.usage.cached_input_tokens) // 4)
    ranges = [(e.attributes["tandem.positions.start"], e.attributes["tandem.positions.end"]) for e in chunks]
    assert ranges[0][0] == finished.usage.cached_input_tokens and ranges[-1][1] == num_positions
    assert all(prev[1] == nxt[0] for prev, nxt in zip(ranges, ranges[1:], strict=False))
    times = [e.timestamp for e in completion.events]
    assert times == sorted(times)
    assert completion.start_time - 5_000_000 <= times[0] and times[-1] <= completion.end_time + 5_000_000

    e = embedding.attributes
    assert e[otel.GEN_AI_OPERATION_NAME] == "embeddings" and e[otel.GEN_AI_REQUEST_MODEL] == MODEL
    assert e[otel.GEN_AI_EMBEDDINGS_DIMENSION_COUNT] == 64
    assert e[otel.GEN_AI_USAGE_INPUT_TOKENS] == len(embedded.token_ids.ids) == num_rows
    assert e[otel.GEN_AI_RESPONSE_ID] == embedded.request_id


@pytest.mark.parametrize("how", ["call.cancel", "task.cancel"])
async def test_cancelling_a_traced_stream_aborts_the_request(traced: Traced, how: str) -> None:
    stack = traced.stack
    call = stack.decoder.generate(generate_request([[1, 2, 3]], 4000, temperature=0.0))
    first_delta = asyncio.Event()

    async def consume() -> None:
        async for response in call:
            if response.HasField("delta"):
                first_delta.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(first_delta.wait(), 10)
    assert stack.engine.core.num_live() == 1
    if how == "call.cancel":
        call.cancel()
    else:
        task.cancel()
    with pytest.raises((asyncio.CancelledError, grpc.aio.AioRpcError)):
        await task
    await wait_for(lambda: stack.engine.core.num_live() == 0 and named(traced.spans, TEXT_COMPLETION))
    (completion,) = named(traced.spans, TEXT_COMPLETION)
    assert completion.attributes[otel.ERROR_TYPE] == "CANCELLED"
    assert completion.status.status_code is StatusCode.ERROR
    assert otel.GEN_AI_USAGE_OUTPUT_TOKENS not in completion.attributes
    # The gRPC server span says CANCELLED too (it said 0), no server error by the RPC conventions.
    await wait_for(lambda: decoder_generate(traced.spans))
    (server,) = decoder_generate(traced.spans)
    assert server.attributes["rpc.grpc.status_code"] == grpc.StatusCode.CANCELLED.value[0]
    assert server.status.status_code is StatusCode.UNSET
    assert stack.engine.core.block_manager.num_free_blocks == stack.engine.core.block_manager.num_total_blocks


async def test_a_stream_past_its_deadline_is_traced_as_deadline_exceeded(traced: Traced) -> None:
    # grpc cancels the handler when the deadline passes: its span said CANCELLED, its caller saw
    # DEADLINE_EXCEEDED.
    stack = traced.stack
    call = stack.decoder.generate(generate_request([[1, 2, 3]], 4000, temperature=0.0), timeout=0.5)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for _ in call:
            pass
    assert caught.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    await wait_for(lambda: stack.engine.core.num_live() == 0 and named(traced.spans, TEXT_COMPLETION))
    (completion,) = named(traced.spans, TEXT_COMPLETION)
    assert completion.attributes[otel.ERROR_TYPE] == "DEADLINE_EXCEEDED"
    assert completion.status.status_code is StatusCode.ERROR
    # So does the gRPC server span (it said 0, unset), a server error by the RPC conventions.
    await wait_for(lambda: decoder_generate(traced.spans))
    (server,) = decoder_generate(traced.spans)
    assert server.attributes["rpc.grpc.status_code"] == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    assert server.status.status_code is StatusCode.ERROR


async def test_a_stream_cut_just_short_of_its_deadline_is_the_deadlines_on_both_spans(traced: Traced) -> None:
    # The server's deadline starts when the call reaches it, after its caller's: grpc cut streams whose
    # deadline had passed with up to 3.7 ms of the server's time left, and both spans said CANCELLED. A cut
    # within DEADLINE_SLACK_S of the deadline is the deadline's, by one rule for both spans; here the cut
    # comes 20 ms short, which the server cannot tell from the deadline's.
    stack = traced.stack
    started = time.monotonic()
    call = stack.decoder.generate(generate_request([[1, 2, 3]], 4000, temperature=0.0), timeout=0.5)
    try:
        async for response in call:
            if response.HasField("delta"):
                break
    except grpc.aio.AioRpcError as error:  # a box so loaded the deadline came first: the same verdict
        assert error.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    await asyncio.sleep(max(0.0, started + 0.48 - time.monotonic()))
    call.cancel()
    await wait_for(lambda: stack.engine.core.num_live() == 0 and named(traced.spans, TEXT_COMPLETION))
    (completion,) = named(traced.spans, TEXT_COMPLETION)
    assert completion.attributes[otel.ERROR_TYPE] == "DEADLINE_EXCEEDED"
    await wait_for(lambda: decoder_generate(traced.spans))
    (server,) = decoder_generate(traced.spans)
    assert server.attributes["rpc.grpc.status_code"] == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    assert server.status.status_code is StatusCode.ERROR


async def test_metrics_record_ttft_and_token_counts(traced: Traced) -> None:
    stack = traced.stack
    prompt = [[5, 6, 7, 8, 9]]
    text, finished = await stack.decoder.generate_text(prompt, max_new_tokens=4, ignore_eos=True)
    await wait_for(lambda: points(traced.decoder_metrics, otel.GEN_AI_SERVER_REQUEST_DURATION))

    m = traced.decoder_metrics
    (ttft,) = points(m, otel.GEN_AI_SERVER_TIME_TO_FIRST_TOKEN)
    assert ttft.count == 1 and ttft.sum == pytest.approx(finished.time_to_first_token_s)
    (tpot,) = points(m, otel.GEN_AI_SERVER_TIME_PER_OUTPUT_TOKEN)
    expected_tpot = (finished.total_time_s - finished.time_to_first_token_s) / 3
    assert tpot.count == 1 and tpot.sum == pytest.approx(expected_tpot)
    (duration,) = points(m, otel.GEN_AI_SERVER_REQUEST_DURATION)
    assert duration.count == 1 and duration.sum >= finished.total_time_s
    assert dict(duration.attributes) == {
        otel.GEN_AI_OPERATION_NAME: "text_completion",
        otel.GEN_AI_PROVIDER_NAME: "tandem",
        otel.GEN_AI_REQUEST_MODEL: MODEL,
    }
    tokens = {p.attributes[otel.TANDEM_TOKEN_KIND]: p.value for p in points(m, otel.TANDEM_SERVER_TOKENS)}
    assert tokens == {"prompt_token": 5, "output": 4}
    requests = {
        p.attributes[otel.TANDEM_REQUEST_STATE]: p.value for p in points(m, otel.TANDEM_ENGINE_REQUESTS)
    }
    assert requests == {"running": 0, "waiting": 0, "paused": 0}
    blocks = {
        p.attributes[otel.TANDEM_KV_BLOCK_STATE]: p.value for p in points(m, otel.TANDEM_ENGINE_KV_BLOCKS)
    }
    assert sum(blocks.values()) == stack.engine.core.block_manager.num_total_blocks
    (queried,) = points(m, otel.TANDEM_ENGINE_PREFIX_CACHE_QUERY_TOKENS)
    assert queried.value == stack.engine.core.block_manager.num_prefix_queries_tokens
    (proposed,) = points(m, otel.TANDEM_ENGINE_SPECULATIVE_PROPOSED_TOKENS)
    (accepted,) = points(m, otel.TANDEM_ENGINE_SPECULATIVE_ACCEPTED_TOKENS)
    assert (proposed.value, accepted.value) == (0, 0)  # this server does not speculate

    usage = {
        p.attributes[otel.GEN_AI_TOKEN_TYPE]: (p.count, p.sum)
        for p in points(traced.client_metrics, otel.GEN_AI_CLIENT_TOKEN_USAGE)
    }
    assert usage == {"input": (1, 5), "output": (1, 4)}
    # The client's duration is recorded by the call's done callback, just after the stream ends.
    await wait_for(lambda: points(traced.client_metrics, otel.GEN_AI_CLIENT_OPERATION_DURATION))
    (client_duration,) = points(traced.client_metrics, otel.GEN_AI_CLIENT_OPERATION_DURATION)
    assert client_duration.count == 1 and client_duration.sum >= finished.total_time_s


async def test_rejected_request_is_counted_and_traced_with_its_error_type(traced: Traced) -> None:
    stack = traced.stack
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await stack.decoder.generate_text([[10**6]], max_new_tokens=2)
    assert raised.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    await wait_for(lambda: named(traced.spans, TEXT_COMPLETION))
    (completion,) = named(traced.spans, TEXT_COMPLETION)
    assert completion.attributes[otel.ERROR_TYPE] == "INVALID_ARGUMENT"
    (rejected,) = points(traced.decoder_metrics, otel.TANDEM_SERVER_REJECTED)
    assert rejected.value == 1 and rejected.attributes[otel.ERROR_TYPE] == "INVALID_ARGUMENT"
    await wait_for(lambda: points(traced.client_metrics, otel.GEN_AI_CLIENT_OPERATION_DURATION))
    (client_duration,) = points(traced.client_metrics, otel.GEN_AI_CLIENT_OPERATION_DURATION)
    assert client_duration.attributes[otel.ERROR_TYPE] == "INVALID_ARGUMENT"


async def test_telemetry_off_installs_nothing_and_records_no_spans(
    tiny_model_dir: Path, tiny_fp32: LoadedModel, lookup: LookupEmbedder
) -> None:
    # A provider of the test's own, to catch any span the services or the client would make.
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    off = otel.setup_telemetry("tandem-decoder", {})
    assert not off.is_enabled and off.server_interceptors() == [] and off.client_interceptors() == []

    stack = await start_stack(tiny_model_dir, tiny_fp32, lookup, lambda service: off)
    try:
        with provider.get_tracer("test").start_as_current_span("root"):
            embedded = await stack.encoder.embed(text="hello")
            text, finished = await stack.decoder.generate_text(
                [[1, 2], embedded.embeddings], max_new_tokens=3, ignore_eos=True
            )
        assert finished.usage.output_tokens == 3
    finally:
        await stop_stack(stack)
    assert [s.name for s in exporter.get_finished_spans()] == ["root"]


CLIENT_SCRIPT = """
import asyncio, sys
from tandem.client.client import DecoderClient, EncoderClient

async def main(encoder_address, decoder_address):
    async with EncoderClient(encoder_address) as encoder, DecoderClient(decoder_address) as decoder:
        embedded = await encoder.embed(text="hello")
        await decoder.generate_text([embedded.embeddings], max_new_tokens=3, ignore_eos=True)

asyncio.run(main(*sys.argv[1:]))
"""


def _json_objects(text: str) -> list[dict]:
    decoder, found, at = json.JSONDecoder(), [], 0
    while (at := text.find("{", at)) != -1:
        value, at = decoder.raw_decode(text, at)
        found.append(value)
    return found


@pytest.mark.parametrize("environment", [{"OTEL_TRACES_EXPORTER": "console"}, {}], ids=["otel", "none"])
async def test_a_client_given_no_telemetry_traces_when_the_otel_environment_asks(
    traced: Traced, environment: dict[str, str]
) -> None:
    encoder_server, decoder_server = traced.stack.servers[1], traced.stack.servers[0]
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")} | environment
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CLIENT_SCRIPT, encoder_server.address, decoder_server.address,
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 0, err.decode()
    spans = {s["name"]: s for s in _json_objects(out.decode())}
    if not environment:
        assert spans == {}
        return
    completion, grpc_span = spans["text_completion"], spans["/tandem.v1.Decoder/Generate"]
    assert completion["kind"] == "SpanKind.CLIENT"
    assert completion["resource"]["attributes"]["service.name"] == "tandem-client"
    assert completion["attributes"][otel.GEN_AI_USAGE_OUTPUT_TOKENS] == 3
    assert completion["attributes"][otel.GEN_AI_RESPONSE_FINISH_REASONS] == ["length"]
    assert grpc_span["parent_id"] == completion["context"]["span_id"]
    assert spans["embeddings"]["attributes"][otel.GEN_AI_EMBEDDINGS_DIMENSION_COUNT] == 64
