"""One batch on the worker thread: every call's outcome is its own, whatever fails; a call whose caller
has left is skipped, and nobody else's rows change."""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image

from services.encoder.tests.vision_checkpoints import make_image
from tandem.client.errors import InvalidArgument, ResourceExhausted
from tandem.client.pb.tandem.v1 import encoder_pb2, tensor_pb2
from tandem.common.torch_part import shared_memory, shm_digest, shm_probe, shm_segment_maps, tensors
from tandem.encoder.batch import EmbedOutput, run_batch
from tandem.encoder.batcher import CallerGone
from tandem.encoder.embedder import EmbedderInfo, Pooling
from tandem.encoder.request import EmbedJob, ImageJob
from tandem.encoder.shared_segments import SharedSegments
from tandem.encoder.vision.embedder import VisionLanguageEmbedder
from tandem.encoder.vision.image_span import PreparedImage

HIDDEN = 4
POISON = 255  # an image whose first pixel is this fails the tower


def _png(size: tuple[int, int], value: int = 10) -> bytes:
    out = io.BytesIO()
    Image.new("L", size, value).save(out, "PNG")
    return out.getvalue()


@dataclass
class FakeEmbedder:
    """Images of any size become 2 rows; the tower fails on a batch holding a poison image, and runs out
    of memory on one holding a size-3 image."""

    tower_calls: int = 0
    num_prepared: int = 0

    @property
    def info(self) -> EmbedderInfo:
        return EmbedderInfo("vision", HIDDEN, 100, torch.float32, 4, image_placeholder="<image>")

    def embed(self, token_ids: list[int], pooling: Pooling) -> torch.Tensor:
        if 99 in token_ids:
            raise RuntimeError("a bug in the text path")
        return torch.ones(len(token_ids), HIDDEN)

    def image_span_size(self, width: int, height: int) -> int:
        return 2

    def prepare_image(self, image: Image.Image) -> PreparedImage:
        self.num_prepared += 1
        if image.size[0] == 7:
            raise MemoryError
        first = image.convert("L").getpixel((0, 0))
        return PreparedImage(torch.full((1, 1, 1, 1), float(first)), [5, 5] if image.size[0] != 3 else [6, 6])

    def embed_images(self, images: list[PreparedImage]) -> list[torch.Tensor]:
        self.tower_calls += 1
        if any(p.pixels.item() == POISON for p in images):
            raise RuntimeError("the tower failed")
        if any(p.token_ids == [6, 6] for p in images):
            raise MemoryError
        return [torch.full((2, HIDDEN), p.pixels.item()) for p in images]


def _image(data: bytes, max_input_tokens: int = 64, max_message_bytes: int = 1 << 20) -> ImageJob:
    return ImageJob(
        "r",
        data,
        Pooling.NONE,
        None,
        max_image_pixels=1 << 20,
        max_input_tokens=max_input_tokens,
        max_message_bytes=max_message_bytes,
    )


def test_each_call_of_a_batch_gets_its_own_outcome_whatever_fails() -> None:
    embedder = FakeEmbedder()
    jobs = [
        EmbedJob("t", [1, 2], Pooling.NONE, None),  # fine
        _image(_png((5, 5), 10)),  # fine
        _image(b"not an image"),  # refused by decoding
        _image(_png((5, 5), POISON)),  # fails the batched tower pass, and fails alone
        _image(_png((7, 5))),  # preparing runs out of memory
        EmbedJob("t", [99], Pooling.NONE, None),  # a bug in the text path
        _image(_png((3, 5), 20)),  # out of memory in the tower, alone too
        _image(_png((5, 5), 30)),  # fine: run again alone after the batched pass failed
    ]
    results = run_batch(embedder, jobs)  # type: ignore[arg-type]
    assert isinstance(results[0], EmbedOutput) and isinstance(results[1], EmbedOutput)
    assert isinstance(results[2], InvalidArgument) and results[2].field == "image.data"
    assert isinstance(results[3], RuntimeError) and "tower failed" in str(results[3])
    assert isinstance(results[4], InvalidArgument) and "MemoryError" in str(results[4])
    assert isinstance(results[5], RuntimeError) and "text path" in str(results[5])
    assert isinstance(results[6], ResourceExhausted) and str(results[6]).startswith("image: ")
    assert isinstance(results[7], EmbedOutput)
    assert embedder.tower_calls == 1 + 4  # the batch, then each of its four images alone


def test_a_batch_that_succeeds_runs_the_tower_once() -> None:
    embedder = FakeEmbedder()
    results = run_batch(embedder, [_image(_png((5, 5), v)) for v in (1, 2, 3)])  # type: ignore[arg-type]
    assert all(isinstance(r, EmbedOutput) for r in results) and embedder.tower_calls == 1


def test_a_span_or_reply_too_long_is_refused_from_the_header_before_decoding() -> None:
    embedder = FakeEmbedder()
    long_span, big_reply = (
        _image(_png((5, 5)), max_input_tokens=1),
        _image(_png((5, 5)), max_message_bytes=100),
    )
    results = run_batch(embedder, [long_span, big_reply])  # type: ignore[arg-type]
    assert isinstance(results[0], InvalidArgument) and "span of 2 rows exceeds max_input_tokens 1" in str(
        results[0]
    )
    assert isinstance(results[1], InvalidArgument) and "over max_message_bytes 100" in str(results[1])
    assert embedder.num_prepared == 0 and embedder.tower_calls == 0


@dataclass
class WritingEmbedder(FakeEmbedder):
    """Its text rows are one per token ID, written where it is told."""

    num_written_into: int = 0

    def embed_into(self, token_ids: list[int], out: torch.Tensor) -> None:
        self.num_written_into += 1
        out.copy_(torch.arange(len(token_ids) * HIDDEN, dtype=torch.float32).view(-1, HIDDEN))


def test_text_rows_go_straight_into_a_segment_only_when_they_are_one_per_id_in_the_embedders_dtype(
    tmp_path: Path,
) -> None:
    probe, segments = shm_probe.Probe.create(tmp_path), SharedSegments(tmp_path, 1 << 20, 8, 5.0)
    reader = shm_segment_maps.SegmentMaps(tmp_path)
    assert probe is not None
    try:
        keys, jobs = [], []
        for pooling, dtype in ((Pooling.NONE, None), (Pooling.MEAN, None), (Pooling.NONE, torch.bfloat16)):
            offer = encoder_pb2.SharedMemoryOffer(
                probe_name=probe.name,
                probe_token=probe.token,
                segment_name=shared_memory.new_name(shared_memory.SEGMENT_PREFIX),
                digest_key=os.urandom(shm_digest.KEY_BYTES),
            )
            keys.append(offer.digest_key)
            jobs.append(EmbedJob("t", [1, 2, 3], pooling, dtype, shared=segments.target(offer)))
        embedder = WritingEmbedder()
        results = run_batch(embedder, jobs)  # type: ignore[arg-type]
        assert embedder.num_written_into == 1  # the other two: embedded, then copied in (cast)
        expected = [torch.arange(12.0).view(3, 4), torch.ones(3, HIDDEN), torch.ones(3, HIDDEN).bfloat16()]
        for result, key, rows in zip(results, keys, expected, strict=True):
            assert isinstance(result, EmbedOutput)
            handle = result.embeddings
            assert isinstance(handle, tensor_pb2.SharedTensor)
            with reader.open(handle.name) as segment:
                assert torch.equal(tensors.decode_shared(handle, segment, key), rows)
    finally:
        reader.close()
        segments.close()
        probe.close()


class CountingVisionEmbedder(VisionLanguageEmbedder):
    """A real tiny LLaVA that counts the images it prepares."""

    num_prepared = 0

    def prepare_image(self, image: Image.Image) -> PreparedImage:
        self.num_prepared += 1
        return super().prepare_image(image)


def test_an_image_whose_caller_left_after_its_batch_started_is_skipped_and_its_neighbours_rows_are_unchanged(
    tiny_llava: Path, tmp_path: Path
) -> None:
    embedder = CountingVisionEmbedder.load(tiny_llava, torch.float32)
    landscape = make_image(tmp_path / "landscape.png", (53, 41), seed=1).read_bytes()
    portrait = make_image(tmp_path / "portrait.png", (30, 70), seed=2).read_bytes()
    jobs = [_image(landscape), _image(portrait), EmbedJob("t", [1, 2], Pooling.NONE, None), _image(landscape)]
    everyone = run_batch(embedder, jobs)  # type: ignore[arg-type]
    assert embedder.num_prepared == 3
    # The caller of jobs[1] leaves once the first image is prepared, as the batch runs.
    embedder.num_prepared = 0
    without_one = run_batch(embedder, jobs, lambda i: i == 1 and embedder.num_prepared >= 1)  # type: ignore[arg-type]
    assert embedder.num_prepared == 2  # its image was never decoded nor preprocessed
    assert isinstance(without_one[1], CallerGone)
    for i in (0, 2, 3):
        kept, reference = without_one[i], everyone[i]
        assert isinstance(kept, EmbedOutput) and isinstance(reference, EmbedOutput)
        assert kept.token_ids == reference.token_ids
        assert torch.equal(tensors.decode(kept.embeddings), tensors.decode(reference.embeddings))


def test_an_image_whose_caller_left_while_later_ones_were_prepared_stays_out_of_the_tower_pass() -> None:
    embedder = FakeEmbedder()
    towered: list[int] = []
    embed_images = embedder.embed_images
    embedder.embed_images = lambda images: towered.append(len(images)) or embed_images(images)  # type: ignore[method-assign]
    jobs = [_image(_png((5, 5), v)) for v in (1, 2, 3)]
    results = run_batch(embedder, jobs, lambda i: i == 0 and embedder.num_prepared == 3)  # type: ignore[arg-type]
    assert embedder.num_prepared == 3 and towered == [2]
    assert isinstance(results[0], CallerGone)
    assert [tensors.decode(r.embeddings)[0, 0].item() for r in results[1:]] == [2.0, 3.0]  # type: ignore[union-attr]
