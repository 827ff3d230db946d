"""What a vision model makes of one image before the tower runs: its tiles and its span of tokens.

The span is what replaces the template's one image placeholder in the prompt: for LLaVA, `num_rows`
image tokens; for SmolVLM, its tiles' image tokens framed by the row/column marker tokens the
processor writes. The embedder fills the span's image tokens with the tower's rows in order and the
other tokens with the language model's own token rows, so one embedding part carries the whole span.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from PIL import Image


@dataclass(frozen=True)
class PreparedImage:
    pixels: torch.Tensor  # [tiles, channels, side, side] float32, every tile the tower's size
    token_ids: list[int]  # the span: image tokens where the tower's rows go, in order, and markers


class VisionModel(Protocol):
    image_token_id: int  # the token the span fills with the tower's rows

    @property
    def tile_shape(self) -> tuple[int, int, int]:
        """(channels, side, side) of every tile."""
        ...

    def describe(self) -> str:
        """One line for the log: which tower, its sizes, what it makes of an image."""
        ...

    def span_size(self, width: int, height: int) -> int:
        """len(prepare(image).token_ids) for a picture of this size, from the size alone (a header's),
        so that every size rule is decided before a pixel is decoded. Raises InvalidArgument for a
        size the processor refuses."""
        ...

    def prepared_pixels(self, width: int, height: int) -> int:
        """The pixels `prepare` makes of a picture of this size: each resize's (one to the size it has is
        skipped: PIL would copy it) and its tiles' (made into tensors). Work beside its decoding's, and
        for a thin picture many times its own pixels: the batcher weighs it. Raises InvalidArgument
        for a size the processor refuses, as span_size does."""
        ...

    def prepare(self, image: Image.Image) -> PreparedImage: ...

    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """[tiles, channels, side, side] -> [tiles, rows per tile, text hidden]."""
        ...
