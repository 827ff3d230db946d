"""Hypothesis-generated requests and raw bytes against live servers.

The promise: every call ends in a normal stream or a status from the documented set, never a
crash, a hang, INTERNAL or UNKNOWN, and the engine is idle with every KV block free afterwards.
TANDEM_FUZZ_EXAMPLES raises the number of examples for longer runs (`make soak`).
"""

from __future__ import annotations

import os

import grpc
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.client.pb.tandem.v1 import decoder_pb2, encoder_pb2, tensor_pb2

from .cases import HIDDEN, VOCAB
from .harness import Services

EXAMPLES = int(os.environ.get("TANDEM_FUZZ_EXAMPLES", "1000"))
ALLOWED = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
FUZZ = settings(
    max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

token_ids = st.lists(st.one_of(st.integers(0, VOCAB - 1), st.integers(0, 2**32 - 1)), max_size=12)
floats = st.floats(allow_nan=True, allow_infinity=True, width=32)


@st.composite
def tensors(draw) -> tensor_pb2.Tensor:
    dtype = draw(st.sampled_from([0, 1, 2, 3, 4, 7]))
    shape = draw(st.lists(st.sampled_from([-1, 0, 1, 2, 3, HIDDEN, HIDDEN + 1, 2**40]), max_size=3))
    if draw(st.booleans()):
        rows = draw(st.integers(1, 4))
        shape = [rows, HIDDEN]
        values = draw(st.lists(floats, min_size=rows * HIDDEN, max_size=rows * HIDDEN))
        data = np.array(values, dtype="<f4").tobytes()
        dtype = 1
    else:
        data = draw(st.binary(max_size=64))
    return tensor_pb2.Tensor(dtype=dtype, shape=shape, data=data)


@st.composite
def segments(draw) -> decoder_pb2.PromptSegment:
    kind = draw(st.sampled_from(["tokens", "text", "embeddings", "empty"]))
    if kind == "tokens":
        return decoder_pb2.PromptSegment(token_ids=tensor_pb2.TokenIds(ids=draw(token_ids)))
    if kind == "text":
        return decoder_pb2.PromptSegment(text=draw(st.text(max_size=40)))
    if kind == "embeddings":
        return decoder_pb2.PromptSegment(embeddings=draw(tensors()))
    return decoder_pb2.PromptSegment()


@st.composite
def valid_segments(draw) -> decoder_pb2.PromptSegment:
    kind = draw(st.sampled_from(["tokens", "text", "embeddings"]))
    if kind == "tokens":
        ids = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12))
        return decoder_pb2.PromptSegment(token_ids=tensor_pb2.TokenIds(ids=ids))
    if kind == "text":
        return decoder_pb2.PromptSegment(text=draw(st.text(min_size=1, max_size=40)))
    rows = draw(st.integers(1, 3))
    values = draw(st.lists(st.floats(-4, 4, width=32), min_size=rows * HIDDEN, max_size=rows * HIDDEN))
    data = np.array(values, dtype="<f4").tobytes()
    return decoder_pb2.PromptSegment(embeddings=tensor_pb2.Tensor(dtype=1, shape=[rows, HIDDEN], data=data))


@st.composite
def valid_generate_requests(draw) -> decoder_pb2.GenerateRequest:
    """Requests inside every limit, varied across sampling modes: these must stream to the end."""
    r = decoder_pb2.GenerateRequest(prompt=draw(st.lists(valid_segments(), min_size=1, max_size=3)))
    r.stopping.max_new_tokens = draw(st.integers(1, 6))
    r.stopping.min_new_tokens = draw(st.integers(0, r.stopping.max_new_tokens))
    r.stopping.stop_sequences.extend(draw(st.lists(st.text(min_size=1, max_size=4), max_size=2)))
    r.stopping.ignore_eos = draw(st.booleans())
    r.sampling.temperature = draw(st.sampled_from([0.0, 0.5, 1.0, 2.0]))
    r.sampling.top_p = draw(st.floats(0.05, 1.0))
    r.sampling.top_k = draw(st.integers(0, 50))
    r.sampling.min_p = draw(st.floats(0.0, 0.5))
    r.sampling.repetition_penalty = draw(st.floats(0.5, 2.0))
    r.sampling.presence_penalty = draw(st.floats(-2.0, 2.0))
    r.sampling.frequency_penalty = draw(st.floats(-2.0, 2.0))
    r.sampling.logit_bias.update(
        draw(st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-5, 5), max_size=3))
    )
    if draw(st.booleans()):
        r.sampling.seed = draw(st.integers(0, 2**64 - 1))
    r.output.logprobs = draw(st.booleans())
    r.output.top_logprobs = draw(st.integers(0, 20))
    if draw(st.booleans()):
        r.output.prompt_logprobs = draw(st.integers(0, 20))
    r.output.stream_interval = draw(st.integers(0, 3))
    r.speculative_tokens = draw(st.integers(0, 16))
    return r


@st.composite
def wild_generate_requests(draw) -> decoder_pb2.GenerateRequest:
    r = decoder_pb2.GenerateRequest(prompt=draw(st.lists(segments(), max_size=4)))
    r.request_id = draw(st.sampled_from(["", "fuzz", "x" * 129]))
    r.stopping.max_new_tokens = draw(st.integers(0, 6))
    r.stopping.min_new_tokens = draw(st.integers(0, 8))
    r.stopping.stop_sequences.extend(draw(st.lists(st.text(max_size=5), max_size=3)))
    r.stopping.stop_token_ids.extend(draw(st.lists(st.integers(0, VOCAB + 5), max_size=3)))
    r.stopping.ignore_eos = draw(st.booleans())
    for name in (
        "temperature",
        "top_p",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
    ):
        if draw(st.booleans()):
            setattr(r.sampling, name, draw(floats))
    if draw(st.booleans()):
        r.sampling.top_k = draw(st.integers(0, 2**32 - 1))
    if draw(st.booleans()):
        r.sampling.seed = draw(st.integers(0, 2**64 - 1))
    r.sampling.logit_bias.update(draw(st.dictionaries(st.integers(0, VOCAB + 5), floats, max_size=3)))
    r.output.logprobs = draw(st.booleans())
    r.output.top_logprobs = draw(st.integers(0, 25))
    if draw(st.booleans()):
        r.output.prompt_logprobs = draw(st.integers(0, 25))
    r.output.omit_text = draw(st.booleans())
    r.output.stream_interval = draw(st.integers(0, 3))
    if draw(st.booleans()):
        r.speculative_tokens = draw(st.integers(0, 2**32 - 1))
    return r


generate_requests = st.one_of(valid_generate_requests(), wild_generate_requests())


OUTCOMES: dict[str, int] = {}  # status name -> count, so the run shows it explored both sides


def _outcome(call) -> None:
    try:
        responses = list(call)
    except grpc.RpcError as error:
        assert error.code() in ALLOWED, f"{error.code()}: {error.details()}"
        OUTCOMES[error.code().name] = OUTCOMES.get(error.code().name, 0) + 1
        return
    assert responses[0].HasField("accepted")
    assert responses[-1].HasField("finished")
    OUTCOMES["OK"] = OUTCOMES.get("OK", 0) + 1


@FUZZ
@given(request=generate_requests)
def test_generated_generate_requests_end_in_a_stream_or_a_documented_status(
    services: Services, request
) -> None:
    _outcome(services.decoder.Generate(request, timeout=30))


@FUZZ
@given(
    text=st.one_of(st.none(), st.text(max_size=80)),
    ids=st.one_of(st.none(), token_ids),
    dtype=st.integers(0, 6),
    pooling=st.integers(0, 4),
)
def test_generated_embed_requests_end_in_a_result_or_a_documented_status(
    services: Services, text, ids, dtype, pooling
) -> None:
    request = encoder_pb2.EmbedRequest(output_dtype=dtype, pooling=pooling)
    if text is not None:
        request.text = text
    elif ids is not None:
        request.token_ids.ids.extend(ids)
    try:
        reply = services.encoder.Embed(request, timeout=30)
    except grpc.RpcError as error:
        assert error.code() in ALLOWED, f"{error.code()}: {error.details()}"
        return
    assert reply.embeddings.shape[-1] == HIDDEN


@FUZZ
@given(raw=st.binary(max_size=200))
def test_random_bytes_on_the_wire_get_a_status(services: Services, raw: bytes) -> None:
    generate = services.decoder_channel.unary_stream(
        "/tandem.v1.Decoder/Generate", lambda b: b, decoder_pb2.GenerateResponse.FromString
    )
    _outcome(generate(raw, timeout=30))
    embed = services.encoder_channel.unary_unary("/tandem.v1.Encoder/Embed", lambda b: b, lambda b: b)
    try:
        embed(raw, timeout=30)
    except grpc.RpcError as error:
        assert error.code() in ALLOWED, f"{error.code()}: {error.details()}"


def test_nothing_leaked_after_fuzzing(services: Services) -> None:
    assert services.idle()
    # Both outcomes were exercised: the strategies are not all-invalid (nor all-valid).
    assert OUTCOMES.get("OK", 0) > 0 and OUTCOMES.get("INVALID_ARGUMENT", 0) > 0, OUTCOMES
    print(f"fuzz outcomes: {OUTCOMES}")
