"""An Embed request too large to be of use is refused unparsed, an image's naming `image.data` and
max_image_bytes as the check on a parsed image does; through a live server, every method still
served."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import pytest

from services.encoder.tests.vision_checkpoints import make_image
from tandem.client import error_reasons as reasons
from tandem.client.channel import channel_options
from tandem.client.errors import ErrorInfo, FailedPrecondition, InvalidArgument
from tandem.client.pb.tandem.v1 import encoder_pb2, encoder_pb2_grpc, tensor_pb2
from tandem.client.status import field_violation
from tandem.common.server import ServerOptions, start_server
from tandem.encoder.config import EncoderConfig
from tandem.encoder.loader import load_embedder
from tandem.encoder.request_size import parse_embed_request
from tandem.encoder.servicer import EncoderServicer

MAX_MESSAGE_BYTES = 1024 * 1024
MAX_IMAGE_BYTES = 64 * 1024


def _image_request(num_bytes: int) -> bytes:
    return encoder_pb2.EmbedRequest(
        image=encoder_pb2.Image(data=b"\x89PNG" + bytes(num_bytes))
    ).SerializeToString()


def test_an_image_over_the_request_bound_names_image_data_and_max_image_bytes() -> None:
    raw = _image_request(200_000)
    with pytest.raises(InvalidArgument) as caught:
        parse_embed_request(raw, 100_000, MAX_IMAGE_BYTES)
    assert caught.value.field == "image.data"
    assert caught.value.description == (
        f"the request is {len(raw)} bytes, its image over max_image_bytes 65536; it was not parsed"
    )
    # The gateway reads this refusal by its reason, not its wording: the image's own bytes and the bound.
    numbers = {reasons.IMAGE_BYTES: "200004", reasons.MAX_IMAGE_BYTES: "65536"}
    assert caught.value.info == ErrorInfo(reasons.IMAGE_TOO_LARGE, reasons.ENCODER, numbers)


def test_an_image_within_max_image_bytes_in_a_request_over_the_bound_is_not_called_over_it() -> None:
    # The image was named over max_image_bytes whenever it was the request's largest field: here 60,004
    # of its bytes, within 65,536, beside a 50,000-byte request_id. Only what is known is said.
    raw = encoder_pb2.EmbedRequest(
        request_id="r" * 50_000, image=encoder_pb2.Image(data=b"\x89PNG" + bytes(60_000))
    ).SerializeToString()
    with pytest.raises(InvalidArgument) as caught:
        parse_embed_request(raw, 100_000, MAX_IMAGE_BYTES)
    assert (caught.value.field, caught.value.description) == (
        "image.data",
        f"the request is {len(raw)} bytes, over the 100000 this method can use, its image holding the most "
        "of them; it was not parsed",
    )


URL_HINT = "is a data: URL, not a picture's bytes; send the PNG, JPEG, WebP or GIF bytes it encodes"


def test_a_picture_sent_as_text_over_the_request_bound_is_named_as_text_as_a_parsed_one_is() -> None:
    # A picture that fits (3/4 of its URL) sent as a data: URL past the request bound (max_image_bytes +
    # 64 KiB) read only "the request is N bytes, its image over max_image_bytes M; it was not parsed",
    # where a URL 64 KiB shorter was named as one: one mistake, two errors by its size. Fields before the
    # image, as a client may send them, do not hide it.
    url = b"data:image/png;base64," + base64.b64encode(bytes(150_000))
    for request in [
        encoder_pb2.EmbedRequest(image=encoder_pb2.Image(data=url)),
        encoder_pb2.EmbedRequest(request_id="r", model="m", image=encoder_pb2.Image(data=url)),
    ]:
        raw = request.SerializeToString()
        with pytest.raises(InvalidArgument) as caught:
            parse_embed_request(raw, 100_000, MAX_IMAGE_BYTES)
        assert (caught.value.field, caught.value.description) == (
            "image.data",
            f"the request is {len(raw)} bytes, its image over max_image_bytes 65536; it was not parsed, "
            f"and it {URL_HINT}",
        )
    base64_png = encoder_pb2.EmbedRequest(
        image=encoder_pb2.Image(data=base64.b64encode(b"\x89PNG\r\n\x1a\n" + bytes(150_000)))
    )
    with pytest.raises(InvalidArgument, match="looks like base64 of a PNG image"):
        parse_embed_request(base64_png.SerializeToString(), 100_000, MAX_IMAGE_BYTES)


def test_an_image_over_the_bound_of_a_model_that_takes_none_is_refused_as_no_image_it_could_take() -> None:
    # It said "image.data: the request is 200012 bytes, its image over max_image_bytes ...": a limit that
    # does not apply, where a 100-byte image is refused as one the model cannot take at all.
    with pytest.raises(FailedPrecondition) as caught:
        parse_embed_request(_image_request(200_000), 100_000, MAX_IMAGE_BYTES, takes_images=False)
    assert (caught.value.field, caught.value.description) == (
        "image",
        "this encoder's model takes no images (serve a LLaVA or SmolVLM checkpoint)",
    )


def test_other_inputs_over_the_bound_keep_their_own_field_and_a_request_within_it_is_parsed() -> None:
    ids = encoder_pb2.EmbedRequest(token_ids=tensor_pb2.TokenIds(ids=[7] * 50_000)).SerializeToString()
    with pytest.raises(InvalidArgument) as caught:
        parse_embed_request(ids, 10_000, MAX_IMAGE_BYTES)
    assert caught.value.field == "token_ids" and "its longest useful input" in caught.value.description
    assert len(parse_embed_request(ids, None, MAX_IMAGE_BYTES).token_ids.ids) == 50_000  # not attached yet
    assert parse_embed_request(_image_request(10), 100_000, MAX_IMAGE_BYTES).image.data.startswith(b"\x89PNG")


@asynccontextmanager
async def _live_encoder(
    model_dir: Path, **settings: object
) -> AsyncIterator[tuple[EncoderServicer, encoder_pb2_grpc.EncoderStub]]:
    """An encoder serving `model_dir` on a free port, its text bound 64 tokens, and a stub to it that
    sends up to twice its max_message_bytes (so gRPC's own refusal can be seen)."""
    config = EncoderConfig(
        model_dir=model_dir,
        dtype="float32",
        max_input_tokens=64,
        server=ServerOptions(host="127.0.0.1", port=0, max_message_bytes=MAX_MESSAGE_BYTES),
        **settings,  # type: ignore[arg-type]
    )
    servicer = EncoderServicer(config)
    server = await start_server(config.server, [servicer.service()])
    servicer.attach(load_embedder(config))
    channel = grpc.aio.insecure_channel(server.address, options=channel_options(2 * MAX_MESSAGE_BYTES))
    try:
        yield servicer, encoder_pb2_grpc.EncoderStub(channel)
    finally:
        await channel.close()
        await server.stop(0)
        servicer.close()


async def test_a_live_encoder_names_image_data_and_its_limit_for_an_image_too_large_to_parse(
    tiny_llava: Path, tmp_path: Path
) -> None:
    # max_input_tokens 64: the text bound under the image's
    async with _live_encoder(tiny_llava, max_image_bytes=MAX_IMAGE_BYTES) as (servicer, stub):
        bound = servicer.max_embed_request_bytes()
        assert bound is not None and bound < 200_000 < MAX_MESSAGE_BYTES
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stub.Embed(encoder_pb2.EmbedRequest(image=encoder_pb2.Image(data=bytes(200_000))))
        # It said "image: the request is 200008 bytes; this method can use at most ... (its longest useful
        # input)": another field's name, and no limit a caller could look up.
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error.value.details().startswith("image.data: the request is 200008 bytes, its image over ")
        assert field_violation(error.value) == (
            "image.data",
            "the request is 200008 bytes, its image over max_image_bytes 65536; it was not parsed",
        )
        url = b"data:image/png;base64," + base64.b64encode(bytes(150_000))  # its bytes would fit
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stub.Embed(encoder_pb2.EmbedRequest(image=encoder_pb2.Image(data=url)))
        assert len(url) > bound and field_violation(error.value)[1].endswith(
            f"it was not parsed, and it {URL_HINT}"
        )
        # Past max_message_bytes gRPC refuses the message before any of the encoder's code sees it.
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stub.Embed(encoder_pb2.EmbedRequest(image=encoder_pb2.Image(data=bytes(MAX_MESSAGE_BYTES))))
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # Every method is still served, Embed of an image within the bound included.
        picture = make_image(tmp_path / "square.png", (36, 36)).read_bytes()
        reply = await stub.Embed(encoder_pb2.EmbedRequest(image=encoder_pb2.Image(data=picture)))
        assert list(reply.embeddings.shape) == [36, 64]
        tokens = await stub.Tokenize(encoder_pb2.EncoderTokenizeRequest(texts=["a picture"]))
        assert len(tokens.tokens) == 1 and tokens.tokens[0].ids
        info = await stub.GetModelInfo(encoder_pb2.EncoderGetModelInfoRequest())
        assert (info.accepts_images, info.max_image_bytes) == (True, MAX_IMAGE_BYTES)


async def test_a_live_text_encoder_refuses_any_image_as_one_its_model_cannot_take(tiny_model: Path) -> None:
    async with _live_encoder(tiny_model) as (servicer, stub):
        bound = servicer.max_embed_request_bytes()
        assert bound is not None and bound < 200_000 < servicer.config.image_bytes_limit
        for num_bytes in (100, 200_000):  # parsed, and refused from its size unparsed: one answer
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await stub.Embed(encoder_pb2.EmbedRequest(image=encoder_pb2.Image(data=bytes(num_bytes))))
            assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION, error.value.details()
            assert error.value.details() == (
                "image: this encoder's model takes no images (serve a LLaVA or SmolVLM checkpoint)"
            )


async def test_a_live_encoder_names_the_embed_field_that_is_not_utf8_though_embed_has_its_own_parser(
    tiny_model: Path,
) -> None:
    # Embed is parsed by servicer.parse_embed, which carries no message type: the refusal read "request:
    # not a valid request message for /tandem.v1.Encoder/Embed: ... String field had bad UTF-8" where
    # Tokenize, parsed by its message's own FromString, named texts[0].
    not_utf8 = b"\xff\xfe"
    embed = encoder_pb2.EmbedRequest(model="m", text="@@").SerializeToString().replace(b"@@", not_utf8)
    tokenize = encoder_pb2.EncoderTokenizeRequest(texts=["@@"]).SerializeToString().replace(b"@@", not_utf8)
    config = EncoderConfig(model_dir=tiny_model, server=ServerOptions(host="127.0.0.1", port=0))
    servicer = EncoderServicer(config)
    server = await start_server(config.server, [servicer.service()])
    servicer.attach(load_embedder(config))
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            for method, raw, field in [("Embed", embed, "text"), ("Tokenize", tokenize, "texts[0]")]:
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    await channel.unary_unary(f"/tandem.v1.Encoder/{method}")(raw, timeout=5)
                assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert field_violation(error.value) == (
                    field,
                    "is not valid UTF-8 (a string field holds UTF-8 text only)",
                ), method
    finally:
        await server.stop(0)
        servicer.close()
