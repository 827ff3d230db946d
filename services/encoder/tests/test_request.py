"""Embed request building: every rule once, cheapest first, errors naming the request field."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tandem.client.errors import InvalidArgument
from tandem.common.torch_part.prompt_parts import TextPrompt
from tandem.encoder import request
from tandem.encoder.embedder import EmbedderInfo, Pooling
from tandem.encoder.request import DECODE_S_PER_PIXEL, RESPONSE_OVERHEAD_BYTES, EmbedSpec, ImageJob, build_job
from tandem.encoder.vision.image_bytes import MAX_IMAGE_SIDE

INFO = EmbedderInfo(kind="fake", hidden_size=4, vocab_size=100, dtype=torch.float32, max_token_chars=5)


class FakeEmbedder:
    """Tokenizes one ID per word; counts its calls."""

    info = INFO

    def __init__(self) -> None:
        self.num_tokenized = 0

    def tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        self.num_tokenized += 1
        return [1 + len(word) for word in text.split()]

    def embed(self, token_ids: list[int], pooling: Pooling) -> torch.Tensor:
        raise AssertionError("request building never embeds")


def _build(spec: EmbedSpec, embedder: FakeEmbedder | None = None, max_input_tokens: int = 8):
    return build_job(spec, embedder or FakeEmbedder(), max_input_tokens, 1 << 20, Pooling.NONE)


def _field(spec: EmbedSpec, **kwargs) -> str:
    with pytest.raises(InvalidArgument) as info:
        _build(spec, **kwargs)
    return info.value.field


def test_each_bad_input_is_refused_naming_its_field() -> None:
    assert _field(EmbedSpec(TextPrompt("hi"), request_id="r" * 129)) == "request_id"
    assert _field(EmbedSpec(None)) == "input"
    assert _field(EmbedSpec(TextPrompt(""))) == "text"
    assert _field(EmbedSpec([])) == "token_ids.ids"
    assert _field(EmbedSpec([1, 100])) == "token_ids.ids[1]"
    assert _field(EmbedSpec([1] * 9)) == "token_ids"
    assert _field(EmbedSpec(TextPrompt("a b c d e f g h i"))) == "text"  # 9 tokens, over 8


def test_a_text_too_long_to_fit_is_refused_from_its_length_before_it_is_tokenized() -> None:
    embedder = FakeEmbedder()
    with pytest.raises(InvalidArgument, match="at least 9 positions") as info:
        _build(EmbedSpec(TextPrompt("a" * (8 * INFO.max_token_chars + 1))), embedder)
    assert info.value.field == "text" and embedder.num_tokenized == 0


def test_a_reply_over_the_message_limit_is_refused_before_embedding() -> None:
    spec = EmbedSpec([1] * 8)  # 8 rows of 4 float32 and 8 IDs: 168 bytes
    with pytest.raises(InvalidArgument, match="over max_message_bytes") as info:
        build_job(spec, FakeEmbedder(), 8, RESPONSE_OVERHEAD_BYTES + 167, Pooling.NONE)
    assert info.value.field == "token_ids"
    assert build_job(spec, FakeEmbedder(), 8, RESPONSE_OVERHEAD_BYTES + 168, Pooling.NONE)


def test_a_valid_call_gets_its_ids_a_request_id_and_the_default_pooling() -> None:
    job = _build(EmbedSpec(TextPrompt("the sea"), add_special_tokens=True))
    assert job.token_ids == [4, 4] and len(job.request_id) == 32 and job.pooling is Pooling.NONE
    job = _build(EmbedSpec([7, 8], request_id="mine", pooling=Pooling.MEAN, output_dtype=torch.float16))
    assert (job.request_id, job.token_ids, job.pooling, job.output_dtype) == (
        "mine",
        [7, 8],
        Pooling.MEAN,
        torch.float16,
    )


def test_an_image_calls_expected_decoding_reads_its_header_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # The batcher weighs a call as it arrives; the header is not walked again on a later look.
    walks: list[bytes] = []

    def declared_size(data: bytes) -> tuple[int, int]:
        walks.append(data)
        return 2000, 2000

    monkeypatch.setattr(request, "declared_size", declared_size)
    job = ImageJob("r", b"png", Pooling.NONE, None, 1 << 20, 64, 1 << 20)
    assert job.expected_s == job.expected_s == (1 << 20) * DECODE_S_PER_PIXEL  # at most the bound
    assert walks == [b"png"]


def test_an_image_is_weighed_by_the_pixels_its_resize_makes_not_only_those_it_declares(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A 184-byte PNG of 1 x 25,890, resized by a shortest-edge-36 processor to 36 x 932,040 before its
    # crop, held the image thread 0.87 s weighed as its own 25,890 pixels (0.8 ms): it went first, and 8
    # of them made one batch of 5.5 s that a neighbour's picture waited behind.
    monkeypatch.setattr(request, "declared_size", lambda data: (1, 25_890))

    def prepared_pixels(width: int, height: int) -> int:
        return 36 * (36 * height // width)

    job = ImageJob("r", b"png", Pooling.NONE, None, 1 << 25, 64, 1 << 20, prepared_pixels=prepared_pixels)
    assert job.expected_s == (25_890 + 36 * 932_040) * DECODE_S_PER_PIXEL
    # One refused from its header before any resize (over the pixel bound, a size the processor
    # refuses) weighs its decode alone, and so does a model that says nothing of its resize.
    assert replace(job, max_image_pixels=25_000).expected_s == 25_000 * DECODE_S_PER_PIXEL

    def refuses(width: int, height: int) -> int:
        raise InvalidArgument("image.data", "an aspect ratio too extreme")

    assert replace(job, prepared_pixels=refuses).expected_s == 25_890 * DECODE_S_PER_PIXEL
    assert replace(job, prepared_pixels=None).expected_s == 25_890 * DECODE_S_PER_PIXEL


def test_an_image_with_a_side_over_max_image_side_weighs_its_decode_alone_its_preparation_never_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # decode_image refuses it from its header (65,536 x 1, within max_image_pixels) before its resize,
    # which for SmolVLM would otherwise be weighed as 2,048 x 2 and tiles; LLaVA's processor refuses
    # such a size itself, Idefics3's does not.
    monkeypatch.setattr(request, "declared_size", lambda data: (MAX_IMAGE_SIDE + 1, 1))

    def asked(width: int, height: int) -> int:
        raise AssertionError("a picture refused from its header is not weighed as prepared")

    job = ImageJob("r", b"png", Pooling.NONE, None, 1 << 25, 64, 1 << 20, prepared_pixels=asked)
    assert job.expected_s == (MAX_IMAGE_SIDE + 1) * DECODE_S_PER_PIXEL


@pytest.mark.parametrize(
    ("data", "description"),
    [
        (b"data:image/png;base64,iVBORw0KGgo=", "is a data: URL"),
        (b"BM" + bytes(64), "is not a PNG, JPEG, WebP or GIF image"),
    ],
)
def test_bytes_that_are_no_picture_by_their_first_bytes_are_refused_before_the_call_is_queued(
    data: bytes, description: str
) -> None:
    # On the image thread they were weighed as the largest picture (no header says a size) and placed
    # ~10 s after their arrival: a data: URL behind 39 pictures heard of it 2.04 s late.
    embedder = FakeEmbedder()
    embedder.info = replace(INFO, image_placeholder="<image>")
    limits = request.ImageLimits(max_image_bytes=1 << 20, max_image_pixels=1 << 20)
    with pytest.raises(InvalidArgument, match=description) as info:
        request.build_image_job(
            EmbedSpec(request.ImageBytes(data)), embedder, limits, 64, 1 << 20, Pooling.NONE
        )
    assert info.value.field == "image.data"
