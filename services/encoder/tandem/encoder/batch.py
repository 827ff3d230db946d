"""One batch of Embed calls, run on the encoder's worker thread: text and token IDs row by row, every
image's tiles through the vision tower in one forward pass.

Each call's outcome is its own: an image that cannot be decoded, or whose span is too long, fails
that call alone (its exception in its slot), and the rest of the batch is answered. So does anything
unexpected (a bug, memory): a failure while preparing one call stays in its slot, and when the
batched tower pass fails, each image is run again alone, so only the one that fails alone fails.

A call whose caller is gone (`is_gone`, asked before each call's own work: an image's decoding and
preprocessing take up to seconds each) is skipped, and left out of the tower pass. The others' rows do
not change: the tower reads each image's tiles apart from its neighbours' (test_batch.py compares them
with the full batch's).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tandem.client.errors import InvalidArgument, ResourceExhausted
from tandem.client.pb.tandem.v1 import tensor_pb2
from tandem.common.torch_part import tensors
from tandem.encoder.batcher import CallerGone
from tandem.encoder.embedder import Embedder, EmbedsInto, Pooling, mean_pool
from tandem.encoder.request import EmbedJob, ImageJob, check_reply_size
from tandem.encoder.vision.image_bytes import decode_image
from tandem.encoder.vision.image_span import PreparedImage


@dataclass(frozen=True)
class EmbedOutput:
    # [num_rows, hidden_size]: packed, or in a shared-memory segment for a caller on this host
    embeddings: tensor_pb2.Tensor | tensor_pb2.SharedTensor
    token_ids: list[int]  # what the rows came from (an image's span: its image tokens and markers)
    placeholder: str  # an image's: what its rows replace in the chat template; "" for text


def run_batch(
    embedder: Embedder,
    jobs: Sequence[EmbedJob | ImageJob],
    is_gone: Callable[[int], bool] = lambda i: False,  # whether the caller of jobs[i] stopped waiting
) -> list[EmbedOutput | Exception]:
    """The outcome of each job, in order: its output, or the exception that failed it alone
    (CallerGone for one skipped)."""
    results: list[EmbedOutput | Exception | None] = [None] * len(jobs)
    images: list[tuple[int, PreparedImage]] = []
    for i, job in enumerate(jobs):
        if is_gone(i):
            results[i] = CallerGone()
            continue
        try:
            if isinstance(job, EmbedJob):
                results[i] = EmbedOutput(_embedded(embedder, job), job.token_ids, "")
            else:
                images.append((i, _prepare(embedder, job)))
        except Exception as error:
            results[i] = error
    for i, _ in images:  # gone while the images after theirs were prepared: out of the tower pass too
        if is_gone(i):
            results[i] = CallerGone()
    images = [(i, prepared) for i, prepared in images if results[i] is None]
    try:
        spans: list = embedder.embed_images([prepared for _, prepared in images]) if images else []  # type: ignore[attr-defined]
    except Exception:
        spans = [CallerGone() if is_gone(i) else _alone(embedder, prepared) for i, prepared in images]
    for (i, prepared), rows in zip(images, spans, strict=True):
        if isinstance(rows, Exception):
            results[i] = rows
            continue
        job = jobs[i]
        if job.pooling is Pooling.MEAN:
            rows = mean_pool(rows)  # [1, hidden_size]
        try:
            packed = _pack(rows, job)
        except Exception as error:
            results[i] = error
            continue
        results[i] = EmbedOutput(packed, prepared.token_ids, embedder.info.image_placeholder)
    assert all(result is not None for result in results)
    return results  # type: ignore[return-value]


def _embedded(embedder: Embedder, job: EmbedJob) -> tensor_pb2.Tensor | tensor_pb2.SharedTensor:
    """A text job's rows as the reply carries them: written by the embedder straight into the job's
    shared-memory segment where it can (one row per token ID, in its own dtype), else embedded here and
    packed."""
    info = embedder.info
    if (
        job.shared is not None
        and job.pooling is Pooling.NONE
        and (job.output_dtype or info.dtype) == info.dtype
        and isinstance(embedder, EmbedsInto)
    ):
        shape = [len(job.token_ids), info.hidden_size]
        handle = job.shared.write_with(shape, info.dtype, lambda out: embedder.embed_into(job.token_ids, out))
        if handle is not None:
            return handle
    rows = embedder.embed(job.token_ids, job.pooling)  # [num_rows, hidden_size]
    return _pack(rows, job)


def _pack(rows: torch.Tensor, job: EmbedJob | ImageJob) -> tensor_pb2.Tensor | tensor_pb2.SharedTensor:
    """The rows as the reply carries them: in the job's shared-memory segment when it has one with
    room, else packed into bytes."""
    if job.shared is not None:
        handle = job.shared.write(rows, job.output_dtype)
        if handle is not None:
            return handle
    return tensors.encode(rows, job.output_dtype)


def _alone(embedder: Embedder, prepared: PreparedImage) -> torch.Tensor | Exception:
    """One image's span rows on its own, or what failed it."""
    try:
        return embedder.embed_images([prepared])[0]  # type: ignore[attr-defined]
    except MemoryError:
        return ResourceExhausted("image: the encoder ran out of memory embedding this image")
    except Exception as error:
        return error


def _prepare(embedder: Embedder, job: ImageJob) -> PreparedImage:
    """Decoded and preprocessed, once every rule on its size has passed on its header alone."""

    def check_size(width: int, height: int) -> None:
        num_rows = embedder.image_span_size(width, height)  # type: ignore[attr-defined]
        if num_rows > job.max_input_tokens:
            raise InvalidArgument(
                "image", f"its span of {num_rows} rows exceeds max_input_tokens {job.max_input_tokens}"
            )
        info = embedder.info
        itemsize = (job.output_dtype or info.dtype).itemsize
        reply_rows = 1 if job.pooling is Pooling.MEAN else num_rows
        check_reply_size(reply_rows, num_rows, info.hidden_size, itemsize, job.max_message_bytes, "image")

    image = decode_image(job.data, len(job.data), job.max_image_pixels, check_size=check_size)
    try:
        return embedder.prepare_image(image)  # type: ignore[attr-defined]
    except (MemoryError, OverflowError) as error:  # a bound the preprocessing checks itself missed
        raise InvalidArgument("image.data", f"cannot be preprocessed: {type(error).__name__}") from None
