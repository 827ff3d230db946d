"""What a body converts to: its gRPC requests and what its handler needs of the body beside them
(`GenerateCall`, `EmbedCall`), so that a large body can be converted in another process and dropped
there (`bodies.py`). The conversions (`chat_request.py`, `completion_request.py`, `embed_request.py`)
make only the checks the gateway alone can make (JSON types, OpenAI's parameter names); every limit
on the content is the services' own, so a prompt is refused here exactly as over gRPC, with the
services' field paths translated back by `errors.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.client.pb.tandem.v1 import decoder_pb2, encoder_pb2
from tandem.gateway.errors import BodyNames


@dataclass(frozen=True)
class ImagePart:
    """An OpenAI image part of a chat body: its place and the image file its data: URL holds."""

    message: int  # index in `messages`
    part: int  # index in that message's content, the body's and the request's alike
    data: bytes  # the image file, for the encoder


@dataclass(frozen=True)
class GenerateCall:
    """A completion body, converted: a Generate request per prompt and what the answer needs of the body.
    Each prompt is asked `n` times, each choice a Generate call of its own (`choices.py`)."""

    # One per prompt, in the body's order: one for a chat and for a completion of one prompt, several
    # for a completion's batch (a list of strings or of token-ID lists). Image parts hold an empty
    # Tensor until `images` are embedded.
    requests: tuple[decoder_pb2.GenerateRequest, ...]
    n: int  # choices per prompt (the body's `n`)
    is_batch: bool  # the body's prompt was a list of prompts: an error of prompt i names prompt[i]
    images: tuple[ImagePart, ...]  # chat only: the image_url parts, in order
    model: str  # the body's `model` ("" when absent)
    is_stream: bool  # server-sent events
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    # The body's names for fields the decoder's errors may name: the field that asked for structured
    # output (`response_format`, `guided_regex`, ...) and its spelling of max_tokens.
    names: BodyNames

    @property
    def num_choices(self) -> int:
        return len(self.requests) * self.n


@dataclass(frozen=True)
class EmbedCall:
    """An embeddings body, converted: one Embed request per input."""

    requests: tuple[encoder_pb2.EmbedRequest, ...]
    model: str
    is_base64: bool  # encoding_format "base64" (else JSON floats)
    is_list: bool = False  # the body's input was a list: an error names input[i], else input

    def input_field(self, i: int, service_field: str) -> str:
        """The body's field for request i's `service_field` (the encoder's: text, token_ids.ids[j],
        image...): input[i] (input[i][j] for an ID), or input alone when the body gave one input."""
        where = f"input[{i}]" if self.is_list else "input"
        if service_field.startswith("token_ids.ids"):
            return where + service_field.removeprefix("token_ids.ids")
        if service_field.startswith("image"):
            return f"{where}.data"
        if service_field == "text" or service_field == "token_ids":
            return where
        return service_field  # the body's own (model): not the input's
