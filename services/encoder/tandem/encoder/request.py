"""An Embed call as the embedder takes it, and its input validated and tokenized into an EmbedJob.

The servicer converts the proto into an EmbedSpec (conversion only: what fails there is an enum it
cannot map). `build_job` checks every rule, once, cheapest first, with errors that name the request
field: the request id; an input set and not empty; text that cannot fit refused from its length
before it is tokenized (tokenizing 30 MB took 27 s and 4 GB it never gave back); then the
positions against max_input_tokens, the IDs against the vocabulary and the reply's size against
max_message_bytes. The rules on the input are `tandem.common.torch_part.prompt_parts`'s, the decoder's as
well.
An image is only checked for what costs nothing here (images accepted, its bytes: their count and,
from the first, that they are a picture and not a data: URL or base64): it is decoded
in its batch (`batch.py`), off the event loop, once every rule on its size (pixels, the resize, the
span) has passed on its header.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tandem.client.errors import FailedPrecondition, InvalidArgument
from tandem.common.text_bounds import check_fits
from tandem.common.torch_part.prompt_parts import (
    TextPrompt,
    check_part,
    check_token_ids,
    how_counted,
    num_positions_at_least,
)
from tandem.common.wire_limits import check_request_id
from tandem.encoder.embedder import Embedder, Pooling
from tandem.encoder.request_size import TAKES_NO_IMAGES
from tandem.encoder.shared_segments import SharedTarget
from tandem.encoder.vision.declared_size import declared_size
from tandem.encoder.vision.image_bytes import MAX_IMAGE_SIDE, check_image_bytes

# Room in a response for everything but the tensor bytes and token IDs (up to 5 bytes each): the request
# ID (at most 128 bytes), the model's name (at most 256: config.py) and token table sample (about 530
# bytes: a decoder checks each reply's model), an image's placeholder (at most 256, from the checkpoint:
# MAX_IMAGE_PLACEHOLDER_BYTES, checked at load), a shared-memory handle, usage and framing.
RESPONSE_OVERHEAD_BYTES = 4096
BYTES_PER_TOKEN_ID = 5
# Seconds of the image thread a decoded pixel costs, decoding and preprocessing it: a lossless WebP of
# 5,792 x 5,792 (34 bytes) took 0.64 s on an idle core (0.36 decoding, 0.28 preprocessing for LLaVA) and
# up to 2.2 s on a busy machine, a 16-bit RGBA PNG as large 2.4 s. A pixel the processor's preparation
# makes costs about as much: an 80-byte PNG of 1 x 297 that LLaVA-1.5 resizes to 336 x 99,792 took
# 0.63 s (19 ns each); SmolVLM-256M's 640 x 480 picture 0.16-0.25 s, 8 ms decoding, 80 its resize to
# 2,048 x 1,536 (25 ns a pixel made), 159 its 13 tiles of 512 x 512 made into tensors (47 ns). Only
# weighs calls against each other.
DECODE_S_PER_PIXEL = 30e-9


@dataclass(frozen=True)
class ImageBytes:
    data: bytes  # an encoded picture as sent (PNG, JPEG, WebP or GIF, read from the bytes when decoded)


@dataclass(frozen=True)
class EmbedSpec:
    """One Embed call as the embedder takes it (the servicer converts the proto into this)."""

    input: TextPrompt | Sequence[int] | ImageBytes | None  # IDs as sent, not copied; None: none was set
    add_special_tokens: bool = False  # text only: the tokenizer adds its BOS/EOS
    request_id: str = ""  # the caller's label, echoed in the reply; "" = a random one is assigned
    pooling: Pooling | None = None  # None: the server's configured pooling
    output_dtype: torch.dtype | None = None  # None: the embedder's native dtype


@dataclass(frozen=True)
class EmbedJob:
    """A valid Embed call: what the embedder runs and the reply echoes."""

    request_id: str  # never empty
    token_ids: list[int]  # [num_tokens], at least one, each in the embedder's vocabulary
    pooling: Pooling
    output_dtype: torch.dtype | None  # None: the embedder's native dtype
    shared: SharedTarget | None = None  # the rows go to shared memory when they can (shared_segments.py)


@dataclass(frozen=True)
class ImageJob:
    """An Embed call of an image, not decoded yet: its batch decodes it, within these limits."""

    request_id: str  # never empty
    data: bytes
    pooling: Pooling
    output_dtype: torch.dtype | None
    max_image_pixels: int
    max_input_tokens: int  # the span's rows count as positions
    max_message_bytes: int
    shared: SharedTarget | None = None  # the rows go to shared memory when they can (shared_segments.py)
    # (width, height) -> the pixels the model's processor makes of a picture of that size, resized and
    # made into tiles (the embedder's `image_prepared_pixels`); None: only the decoding is weighed.
    prepared_pixels: Callable[[int, int], int] | None = None

    @functools.cached_property
    def expected_s(self) -> float:
        """The image thread's time its decoding and preparation should take, from the size its header
        declares: its own pixels (at most max_image_pixels: more is refused before decoding) and those
        its resize and tiles make, which for a thin picture are many times more (a 1 x 297 PNG weighed
        as 297 pixels went first and held the thread 0.63 s), and for SmolVLM, which scales every
        picture to 2,048 on its long side, over 8 M even for a 36 x 36 one. A header that says no size
        is weighed at the bound, so that hiding it buys no place in line. Read once: the header is not
        walked again."""
        size = declared_size(self.data)
        if size is None:
            return self.max_image_pixels * DECODE_S_PER_PIXEL
        width, height = size
        pixels = min(width * height, self.max_image_pixels)
        return (pixels + self._prepared(width, height)) * DECODE_S_PER_PIXEL

    def _prepared(self, width: int, height: int) -> int:
        """The pixels the preparation makes of a picture of this size; 0 where none is weighed or the
        picture is refused from its header before it is prepared (`decode_image`: no pixels, over the
        bounds, or a size the processor refuses)."""
        if self.prepared_pixels is None or not 0 < width * height <= self.max_image_pixels:
            return 0
        if max(width, height) > MAX_IMAGE_SIDE:
            return 0
        try:
            return self.prepared_pixels(width, height)
        except InvalidArgument:
            return 0


@dataclass(frozen=True)
class ImageLimits:
    max_image_bytes: int
    max_image_pixels: int


def check_reply_size(
    num_rows: int, num_ids: int, hidden_size: int, itemsize: int, max_message_bytes: int, field: str
) -> None:
    """The reply (rows and IDs) must fit max_message_bytes."""
    num_bytes = num_rows * hidden_size * itemsize + num_ids * BYTES_PER_TOKEN_ID
    if num_bytes > max_message_bytes - RESPONSE_OVERHEAD_BYTES:
        raise InvalidArgument(
            field,
            f"the response would take about {num_bytes} bytes, over max_message_bytes "
            f"{max_message_bytes}; send a shorter input or a 2-byte output_dtype",
        )


def build_image_job(
    spec: EmbedSpec,
    embedder: Embedder,
    limits: ImageLimits,
    max_input_tokens: int,
    max_message_bytes: int,
    default_pooling: Pooling,
) -> ImageJob:
    """The checks of an image that cost nothing: images accepted, its bytes (`check_image_bytes`)."""
    assert isinstance(spec.input, ImageBytes)
    check_request_id(spec.request_id)
    if not embedder.info.image_placeholder:
        raise FailedPrecondition("image", TAKES_NO_IMAGES)
    data = spec.input.data
    check_image_bytes(data, limits.max_image_bytes)
    return ImageJob(
        spec.request_id or uuid.uuid4().hex,
        data,
        spec.pooling or default_pooling,
        spec.output_dtype,
        limits.max_image_pixels,
        max_input_tokens,
        max_message_bytes,
        prepared_pixels=embedder.image_prepared_pixels,  # type: ignore[attr-defined]
    )


def build_job(
    spec: EmbedSpec,
    embedder: Embedder,
    max_input_tokens: int,  # min(the config's, the embedder's own limit)
    max_message_bytes: int,
    default_pooling: Pooling,
) -> EmbedJob:
    """Validate the spec against the embedder and tokenize its text. Raises InvalidArgument."""
    check_request_id(spec.request_id)
    if spec.input is None:
        raise InvalidArgument("input", "set exactly one of text, token_ids or image")
    assert not isinstance(spec.input, ImageBytes)  # build_image_job's
    info = embedder.info
    field = "text" if isinstance(spec.input, TextPrompt) else "token_ids"
    check_part(spec.input, "", info.hidden_size, accepts_embeddings=False)
    check_fits(
        num_positions_at_least([spec.input], info.max_token_chars),
        max_input_tokens,
        field,
        how_counted([spec.input], info.max_token_chars),
        f"max_input_tokens {max_input_tokens}",
    )
    if isinstance(spec.input, TextPrompt):
        token_ids = embedder.tokenize(spec.input.text, spec.add_special_tokens)
        if not token_ids:
            raise InvalidArgument("text", "produces no tokens; send text with at least one token")
        if len(token_ids) > max_input_tokens:
            raise InvalidArgument(
                "text", f"{len(token_ids)} positions exceed max_input_tokens {max_input_tokens}"
            )
    else:
        check_token_ids(spec.input, "token_ids.ids", info.vocab_size)
        token_ids = list(spec.input)
    pooling = spec.pooling or default_pooling
    num_rows = 1 if pooling is Pooling.MEAN else info.num_virtual_tokens + len(token_ids)
    itemsize = (spec.output_dtype or info.dtype).itemsize
    check_reply_size(num_rows, len(token_ids), info.hidden_size, itemsize, max_message_bytes, field)
    return EmbedJob(spec.request_id or uuid.uuid4().hex, token_ids, pooling, spec.output_dtype)
