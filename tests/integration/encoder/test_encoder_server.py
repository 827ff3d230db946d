"""tandem.v1.Encoder end to end: a real server on loopback serving the lookup embedder."""

import grpc
import pytest
import torch
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_status import rpc_status

from tandem.client.pb.tandem.v1 import encoder_pb2, tensor_pb2
from tandem.common import replica_name
from tandem.common.torch_part import tensors
from tandem.common.torch_part.model_identity import read_table_sample
from tandem.encoder.embedder import Pooling
from tandem.encoder.lookup import LookupEmbedder
from tests.integration.encoder.conftest import (
    MAX_INPUT_TOKENS,
    MAX_MESSAGE_BYTES,
    MODEL_NAME,
    Encoder,
    encoder_config,
    start_encoder,
    stop_encoder,
)

TEXT = "Tandem turns text into rows of the decoder's hidden space."


async def test_health_is_serving_after_load(encoder: Encoder) -> None:
    health = health_pb2_grpc.HealthStub(encoder.channel)
    for name in ["", "tandem.v1.Encoder"]:
        reply = await health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_reflection_lists_the_encoder(encoder: Encoder) -> None:
    stub = reflection_pb2_grpc.ServerReflectionStub(encoder.channel)
    call = stub.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
    )
    names = [s.name async for reply in call for s in reply.list_services_response.service]
    assert {"tandem.v1.Encoder", "grpc.health.v1.Health"} <= set(names)


async def test_embed_and_get_model_info_say_which_replica_answered_as_they_begin(encoder: Encoder) -> None:
    """A decoder balancing over several encoders names the one that answered (`replica_name`); the name
    comes before any work, so a call that then fails carries it too."""
    name = replica_name.own_name("127.0.0.1", encoder.server.port)
    for call in (
        encoder.stub.Embed(encoder_pb2.EmbedRequest(text=TEXT), timeout=10),
        encoder.stub.GetModelInfo(encoder_pb2.EncoderGetModelInfoRequest(), timeout=10),
    ):
        await call
        assert replica_name.reported(await call.initial_metadata()) == name == encoder.server.address
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await encoder.stub.Embed(encoder_pb2.EmbedRequest(), timeout=10)  # no input: refused
    assert replica_name.reported(error.value.initial_metadata()) == name


async def test_embed_text_returns_the_lookup_rows(encoder: Encoder, lookup: LookupEmbedder) -> None:
    reply = await encoder.stub.Embed(encoder_pb2.EmbedRequest(request_id="r1", text=TEXT), timeout=5)
    ids = lookup.tokenize(TEXT, add_special_tokens=False)
    assert reply.request_id == "r1"
    assert list(reply.token_ids.ids) == ids
    assert reply.usage.input_tokens == len(ids) and reply.usage.output_tokens == 0
    rows = tensors.decode(reply.embeddings, rank=2, last_dim=lookup.info.hidden_size)
    assert rows.dtype == torch.bfloat16  # the native dtype
    assert torch.equal(rows, lookup.embed(ids, Pooling.NONE))


@pytest.mark.parametrize(
    ("wire", "dtype"),
    [
        (tensor_pb2.DATA_TYPE_FLOAT32, torch.float32),
        (tensor_pb2.DATA_TYPE_FLOAT16, torch.float16),
        (tensor_pb2.DATA_TYPE_BFLOAT16, torch.bfloat16),
    ],
)
async def test_output_dtype_is_honoured(
    encoder: Encoder, lookup: LookupEmbedder, wire: int, dtype: torch.dtype
) -> None:
    ids = [3, 1, 4, 1, 5]
    request = encoder_pb2.EmbedRequest(token_ids=tensor_pb2.TokenIds(ids=ids), output_dtype=wire)
    reply = await encoder.stub.Embed(request, timeout=5)
    assert reply.embeddings.dtype == wire and list(reply.embeddings.shape) == [5, lookup.info.hidden_size]
    rows = tensors.decode(reply.embeddings)
    assert torch.equal(rows, lookup.embed(ids, Pooling.NONE).to(dtype))


async def test_mean_pooling_returns_one_row(encoder: Encoder, lookup: LookupEmbedder) -> None:
    request = encoder_pb2.EmbedRequest(text=TEXT, pooling=encoder_pb2.POOLING_MEAN)
    reply = await encoder.stub.Embed(request, timeout=5)
    assert list(reply.embeddings.shape) == [1, lookup.info.hidden_size]
    assert reply.usage.input_tokens == len(reply.token_ids.ids) > 1


async def test_server_assigns_a_request_id_when_empty(encoder: Encoder) -> None:
    reply = await encoder.stub.Embed(encoder_pb2.EmbedRequest(text="hi"), timeout=5)
    assert len(reply.request_id) == 32


async def test_matching_model_name_is_accepted(encoder: Encoder) -> None:
    reply = await encoder.stub.Embed(encoder_pb2.EmbedRequest(model=MODEL_NAME, text="hi"), timeout=5)
    assert reply.usage.input_tokens >= 1


def _ids(*ids: int) -> tensor_pb2.TokenIds:
    return tensor_pb2.TokenIds(ids=list(ids))


@pytest.mark.parametrize(
    ("request_kwargs", "field"),
    [
        ({}, "input"),
        ({"text": ""}, "text"),
        ({"token_ids": _ids()}, "token_ids.ids"),
        ({"token_ids": _ids(1, 2, 1024)}, "token_ids.ids[2]"),
        ({"token_ids": _ids(*[1] * (MAX_INPUT_TOKENS + 1))}, "token_ids"),
        ({"text": "many words " * MAX_INPUT_TOKENS}, "text"),
        ({"text": "hi", "output_dtype": tensor_pb2.DATA_TYPE_INT32}, "output_dtype"),
        ({"text": "hi", "pooling": 7}, "pooling"),
        ({"text": "hi", "request_id": "x" * 129}, "request_id"),
        ({"text": "hi", "request_id": "r1\nINFO forged line"}, "request_id"),  # logged as sent
        ({"text": "hi", "request_id": "r1\u2028"}, "request_id"),
        ({"text": "hi", "request_id": "r1 "}, "request_id"),
    ],
    ids=["no-input", "empty-text", "empty-ids", "id-out-of-vocab", "too-many-ids", "too-long-text",
         "int32-output", "unknown-pooling", "long-request-id", "request-id-with-a-newline",
         "request-id-with-a-line-separator", "request-id-with-outer-space"],
)  # fmt: skip
async def test_invalid_requests_name_the_field(encoder: Encoder, request_kwargs: dict, field: str) -> None:
    call = encoder.stub.Embed(encoder_pb2.EmbedRequest(**request_kwargs), timeout=5)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    status = await rpc_status.aio.from_call(call)
    bad_request = error_details_pb2.BadRequest()
    assert status.details[0].Unpack(bad_request)
    assert [v.field for v in bad_request.field_violations] == [field]


async def test_limits_are_stated_in_the_error(encoder: Encoder) -> None:
    request = encoder_pb2.EmbedRequest(token_ids=_ids(*[1] * (MAX_INPUT_TOKENS + 1)))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await encoder.stub.Embed(request, timeout=5)
    assert f"exceed max_input_tokens {MAX_INPUT_TOKENS}" in caught.value.details()


async def test_unknown_model_is_not_found(encoder: Encoder) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await encoder.stub.Embed(encoder_pb2.EmbedRequest(model="gpt-5", text="hi"), timeout=5)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert MODEL_NAME in caught.value.details()


async def test_tokenize_uses_the_decoders_tokenizer(encoder: Encoder, lookup: LookupEmbedder) -> None:
    texts = [TEXT, "", "second"]
    reply = await encoder.stub.Tokenize(encoder_pb2.EncoderTokenizeRequest(texts=texts), timeout=5)
    assert [list(t.ids) for t in reply.tokens] == [
        lookup.tokenize(t, add_special_tokens=False) for t in texts
    ]


async def test_tokenize_refuses_more_than_64_texts(encoder: Encoder) -> None:
    call = encoder.stub.Tokenize(encoder_pb2.EncoderTokenizeRequest(texts=["a"] * 65), timeout=5)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    bad_request = error_details_pb2.BadRequest()
    (await rpc_status.aio.from_call(call)).details[0].Unpack(bad_request)
    assert bad_request.field_violations[0].field == "texts"


async def test_get_model_info_describes_the_embedder(encoder: Encoder, lookup: LookupEmbedder) -> None:
    info = await encoder.stub.GetModelInfo(encoder_pb2.EncoderGetModelInfoRequest(), timeout=5)
    assert (info.model, info.embedder) == (MODEL_NAME, "lookup")
    assert (info.hidden_size, info.vocab_size) == (lookup.info.hidden_size, lookup.info.vocab_size)
    assert info.dtype == tensor_pb2.DATA_TYPE_BFLOAT16
    assert (info.max_input_tokens, info.max_message_bytes) == (MAX_INPUT_TOKENS, MAX_MESSAGE_BYTES)
    assert info.num_virtual_tokens == 0
    # Which model, beyond its shape: its token table's sample, as the checkpoint's files store it.
    sample = read_table_sample(encoder.servicer.config.model_dir, ValueError)
    reported = info.token_table_sample
    assert (reported.vocab_size, reported.hidden_size) == (lookup.info.vocab_size, lookup.info.hidden_size)
    assert tuple(reported.values) == sample.values


async def test_every_embed_reply_names_its_model_and_its_token_table_sample(encoder: Encoder) -> None:
    """A decoder checks each reply's model before it uses the rows: one of several balanced encoders,
    or one restarted on the same port, may serve another model of the same shape."""
    info = await encoder.stub.GetModelInfo(encoder_pb2.EncoderGetModelInfoRequest(), timeout=5)
    for text in ("a", "b"):
        reply = await encoder.stub.Embed(encoder_pb2.EmbedRequest(text=text), timeout=5)
        assert reply.model == MODEL_NAME
        assert reply.token_table_sample == info.token_table_sample


async def test_unavailable_and_not_serving_while_loading(tiny_model) -> None:
    loading = await start_encoder(encoder_config(tiny_model), embedder=None)
    try:
        health = health_pb2_grpc.HealthStub(loading.channel)
        reply = await health.Check(health_pb2.HealthCheckRequest(service="tandem.v1.Encoder"), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await loading.stub.Embed(encoder_pb2.EmbedRequest(text="hi"), timeout=5)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await stop_encoder(loading)
