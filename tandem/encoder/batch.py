"""One batch of Embed calls, run on the encoder's worker thread: text and token IDs row by row, every
image's tiles through the vision tower in one forward pass.

Each call's outcome is its own: an image that cannot be decoded, or whose span is too long, fails
that call alone (its exception in its slot), and the rest of the batch is answered.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tandem.client.errors import InvalidArgument, TandemError
from tandem.client.pb.tandem.v1 import tensor_pb2
from tandem.common import tensors
from tandem.encoder.embedder import Embedder, Pooling, mean_pool
from tandem.encoder.request import EmbedJob, ImageJob, check_reply_size
from tandem.encoder.vision.image_bytes import decode_image
from tandem.encoder.vision.image_span import PreparedImage


@dataclass(frozen=True)
class EmbedOutput:
    embeddings: tensor_pb2.Tensor  # packed [num_rows, hidden_size]
    token_ids: list[int]  # what the rows came from (an image's span: its image tokens and markers)
    placeholder: str  # an image's: what its rows replace in the chat template; "" for text


def run_batch(embedder: Embedder, jobs: Sequence[EmbedJob | ImageJob]) -> list[EmbedOutput | TandemError]:
    """The outcome of each job, in order."""
    results: list[EmbedOutput | TandemError | None] = [None] * len(jobs)
    images: list[tuple[int, PreparedImage]] = []
    for i, job in enumerate(jobs):
        try:
            if isinstance(job, EmbedJob):
                rows = embedder.embed(job.token_ids, job.pooling)  # [num_rows, hidden_size]
                results[i] = EmbedOutput(tensors.encode(rows, job.output_dtype), job.token_ids, "")
            else:
                images.append((i, _prepare(embedder, job)))
        except TandemError as error:
            results[i] = error
    if images:
        spans = embedder.embed_images([prepared for _, prepared in images])  # type: ignore[attr-defined]
        for (i, prepared), rows in zip(images, spans, strict=True):
            job = jobs[i]
            if job.pooling is Pooling.MEAN:
                rows = mean_pool(rows)  # [1, hidden_size]
            packed = tensors.encode(rows, job.output_dtype)
            results[i] = EmbedOutput(packed, prepared.token_ids, embedder.info.image_placeholder)
    assert all(result is not None for result in results)
    return results  # type: ignore[return-value]


def _prepare(embedder: Embedder, job: ImageJob) -> PreparedImage:
    """Decoded (pixels bounded before decoding), preprocessed, and its span within the limits."""
    image = decode_image(job.data, len(job.data), job.max_image_pixels)
    prepared = embedder.prepare_image(image)  # type: ignore[attr-defined]
    num_rows = len(prepared.token_ids)
    if num_rows > job.max_input_tokens:
        raise InvalidArgument(
            "image", f"its span of {num_rows} rows exceeds max_input_tokens {job.max_input_tokens}"
        )
    info = embedder.info
    itemsize = (job.output_dtype or info.dtype).itemsize
    reply_rows = 1 if job.pooling is Pooling.MEAN else num_rows
    check_reply_size(reply_rows, num_rows, info.hidden_size, itemsize, job.max_message_bytes, "image")
    return prepared
