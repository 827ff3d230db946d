"""A chat's pictures: OpenAI's image part, `{"type": "image_url", "image_url": {"url": "data:..."}}`, its
file taken from the data: URL only (`image_file`), and each distinct picture of a request embedded
once, whatever its `n`.

NOTE: who embeds, and how often. A decoder without an encoder of its own takes a picture's rows: the
gateway embeds each distinct file through its encoder (`embed_images`), once however often the chat
repeats it, and every choice's Generate call is a copy of the one prompt holding those rows. A decoder
with an encoder (`accepts_encoder_parts`) takes the file as an `encoder` part and fetches the rows
itself, the rows never passing through the gateway (whose own encoder may not even be reachable);
each Generate call fetches its parts, and the decoder shares one fetch among the calls asking for a
picture at once (`tandem.decoder.api.encoder_parts`), so the n choices go at once and each picture is
still encoded once. Choices that reach different decoder replicas are fetched by each replica.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

import grpc

from tandem.client.errors import InvalidArgument
from tandem.client.pb.tandem.v1 import encoder_pb2, encoder_pb2_grpc, tensor_pb2
from tandem.gateway.calls import GenerateCall, ImagePart
from tandem.gateway.encoder_info import EncoderInfo, Metadata
from tandem.gateway.errors import Refused
from tandem.gateway.fields import shown
from tandem.gateway.image_bytes import over_cap, refusal_asking_again
from tandem.gateway.tasks import all_or_cancel

# An image_url's `detail`, as the openai SDK types it (3.63: "original" too) and so vLLM takes it. Read
# by no one: the encoder sees every picture at its processor's own resolution, whichever is asked.
DETAILS = ("auto", "low", "high", "original")


def image_file(part: dict[str, Any], where: str) -> bytes:
    """An OpenAI image part's file: `{"type": "image_url", "image_url": {"url": "data:...;base64,..."}}`.
    Only data URLs: the gateway fetches nothing (a URL it would fetch is a server-side request forgery
    waiting to happen)."""
    image_url = part.get("image_url")
    url = image_url.get("url") if isinstance(image_url, dict) else image_url
    detail = image_url.get("detail") if isinstance(image_url, dict) else None
    if detail is not None and detail not in DETAILS:
        raise InvalidArgument(f"{where}.detail", f"must be {', '.join(DETAILS)}, got {shown(detail)}")
    # A URL's scheme is case-insensitive (RFC 3986), and so are a media type, its parameters and the
    # base64 token (RFC 2045, 2397): `DATA:IMAGE/PNG;BASE64,` is the same URL, as vLLM takes it.
    header, _, data = url.partition(",") if isinstance(url, str) else ("", "", "")
    header = header.lower()
    if not header.startswith("data:"):
        raise InvalidArgument(
            where, "must be a data: URL (data:image/png;base64,...); the gateway fetches no URL"
        )
    if not header.endswith(";base64"):
        raise InvalidArgument(where, "must be base64 (data:image/...;base64,...)")
    # The encoder reads any file by its bytes, so the media type decides nothing there; a caller who
    # says text/plain (or nothing: RFC 2397's default) has sent something else than a picture.
    media_type = header.removeprefix("data:").split(";", 1)[0].strip()
    if not media_type.startswith("image/"):
        raise InvalidArgument(
            where, f"must be a picture (data:image/...;base64,...), got {shown(media_type)}"
        )
    try:
        file = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidArgument(where, "is not valid base64") from None
    if not file:
        raise InvalidArgument(where, "holds no picture: its base64 is empty")
    return file


def as_encoder_parts(call: GenerateCall) -> None:
    """Each image_url part of `call` as an encoder part of its file, for a decoder that fetches the
    rows from its encoder itself: they never pass through the gateway."""
    for image in call.images:
        part = call.requests[0].chat.messages[image.message].content[image.part]
        part.encoder.CopyFrom(encoder_pb2.EncoderInput(image=encoder_pb2.Image(data=image.data)))


async def embed_images(
    stub: encoder_pb2_grpc.EncoderStub,
    call: GenerateCall,
    info: EncoderInfo,
    max_message_bytes: int,
    metadata: Metadata,
) -> None:
    """The encoder's rows in place of each image_url part of `call`: each distinct file embedded once,
    all of them concurrently (the encoder batches them). A file over a bound (the encoder's, as `info`
    says, or the services' `max_message_bytes`) is a 413 before any call; the encoder's refusal names
    the file's first part."""
    by_file: dict[bytes, list[ImagePart]] = {}
    for image in call.images:
        by_file.setdefault(image.data, []).append(image)
    embeds = []  # each file's Embed request and where the body first gave it, all checked before any call
    for data, parts in by_file.items():
        embed = encoder_pb2.EmbedRequest(image=encoder_pb2.Image(data=data))
        where = f"messages[{parts[0].message}].content[{parts[0].part}].image_url"
        too_large = await refusal_asking_again(info, max_message_bytes, embed, where, metadata)
        if too_large is not None:
            raise Refused(too_large)
        embeds.append((embed, where))

    async def rows(embed: encoder_pb2.EmbedRequest, where: str) -> tuple[bytes, tensor_pb2.Tensor]:
        try:
            reply = await stub.Embed(embed, metadata=metadata)
        except grpc.aio.AioRpcError as error:
            if (too_large := over_cap(error, embed, where, info)) is not None:
                raise Refused(too_large) from None
            if error.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION):
                raise InvalidArgument(where, error.details()) from None
            raise
        return embed.image.data, reply.embeddings

    embedded = await all_or_cancel([rows(embed, where) for embed, where in embeds])
    for data, tensor in embedded:
        for image in by_file[data]:
            call.requests[0].chat.messages[image.message].content[image.part].image.CopyFrom(tensor)
