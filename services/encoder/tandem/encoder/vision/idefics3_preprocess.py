"""An image -> SmolVLM's (Idefics3's) tiles, as transformers' `Idefics3ImageProcessorPil` makes them.

Idefics3 does not squash an image into one square. It resizes the image so its longest edge is
`size["longest_edge"]` (upscaling small images too; the other side kept in proportion and made even),
then, with `do_image_splitting`, resizes it again so both sides are multiples of the tile side
(`max_image_size["longest_edge"]`) and cuts it into a grid of tiles, row by row, followed by the
whole image resized to one tile (the "global" image). Without splitting the image is resized straight
to one tile. Every tile is then rescaled and normalized as CLIP's are. The grid's rows and columns
decide the prompt's markers (`<row_i_col_j>`), so they are returned with the pixels.

Every resize is PIL's on the 8-bit image, in transformers' order (the global image is resized from
the already-resized image, not the original), so the pixels are bit for bit transformers'. Every tile
is exactly one tile side square: a single image is never padded, and needs no pixel mask.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from tandem.client.errors import InvalidArgument
from tandem.encoder.vision.preprocess import rescale_and_normalize
from tandem.encoder.vision.rgb import rgb_for_processor

# transformers' Idefics3ImageProcessorPil defaults, for a config that leaves a key out.
DEFAULT_LONGEST_EDGE = 4 * 364
DEFAULT_TILE = 364
DEFAULT_MEAN_STD = (0.5, 0.5, 0.5)  # IMAGENET_STANDARD_MEAN and _STD
MAX_IMAGE_SIZE = 4096  # transformers' cap on either side after the first resize


@dataclass(frozen=True)
class Tiles:
    """One image's tiles and the grid they were cut from (0 x 0: the image is one tile, not split)."""

    pixels: torch.Tensor  # [tiles, 3, tile, tile] float32: the grid row by row, then the global image
    rows: int
    cols: int


@dataclass(frozen=True)
class Idefics3Processing:
    """The steps of one checkpoint's Idefics3 image processor."""

    longest_edge: int | None  # first resize: the longest edge to this; None: no first resize
    tile: int  # max_image_size["longest_edge"]: every tile's side
    splitting: bool
    resample: Image.Resampling
    rescale_factor: float | None  # None: no rescale
    mean: tuple[float, ...] | None  # None: no normalization
    std: tuple[float, ...] | None
    convert_rgb: bool

    @classmethod
    def from_hf(cls, config: dict[str, Any], error: Callable[[str], Exception]) -> Idefics3Processing:
        """From the image processor's config. Raises `error(message)` for a setting it cannot reproduce."""
        where = "preprocessor_config.json"
        kind = config.get("image_processor_type", "Idefics3ImageProcessor")
        if kind.removesuffix("Fast").removesuffix("Pil") != "Idefics3ImageProcessor":
            raise error(f"{where}: image_processor_type {kind!r} is not Idefics3ImageProcessor")
        longest_edge = None
        if config.get("do_resize", True):
            size = config.get("size", {"longest_edge": DEFAULT_LONGEST_EDGE})
            # transformers also takes a fixed height and width here; no SmolVLM checkpoint uses one.
            if (
                not isinstance(size, dict)
                or not isinstance(size.get("longest_edge"), int)
                or size["longest_edge"] < 1
            ):
                raise error(f"{where}: size {size!r} is not supported (needs a positive longest_edge)")
            longest_edge = size["longest_edge"]
        splitting = bool(config.get("do_image_splitting", True))
        if splitting and longest_edge is None:
            # Without the first resize the grid grows with the image, past any row/column marker.
            raise error(f"{where}: do_resize false with do_image_splitting is not supported")
        max_size = config.get("max_image_size", {"longest_edge": DEFAULT_TILE})
        if not isinstance(max_size, dict) or not isinstance(max_size.get("longest_edge"), int):
            raise error(f"{where}: max_image_size {max_size!r} is not supported (needs longest_edge)")
        try:
            resample = Image.Resampling(int(config.get("resample", Image.Resampling.LANCZOS)))
        except (TypeError, ValueError):
            raise error(f"{where}: resample {config.get('resample')!r} is not a PIL filter") from None
        do_normalize = config.get("do_normalize", True)
        return cls(
            longest_edge=longest_edge,
            tile=max_size["longest_edge"],
            splitting=splitting,
            resample=resample,
            rescale_factor=float(config.get("rescale_factor", 1 / 255))
            if config.get("do_rescale", True)
            else None,
            mean=_per_channel(config.get("image_mean", DEFAULT_MEAN_STD)) if do_normalize else None,
            std=_per_channel(config.get("image_std", DEFAULT_MEAN_STD)) if do_normalize else None,
            convert_rgb=bool(config.get("do_convert_rgb", True)),
        )

    def max_grid_side(self) -> int:
        """The most rows (or columns) of tiles any image can be cut into.

        After the first resize no side exceeds longest_edge rounded up to even (the short side is
        rounded up to even, which can pass an odd longest_edge) nor MAX_IMAGE_SIZE; the second resize
        rounds the longest side up to a multiple of the tile and the other side to no more than that."""
        if not self.splitting or self.longest_edge is None:
            return 0
        longest = self.longest_edge + self.longest_edge % 2
        return math.ceil(min(longest, MAX_IMAGE_SIZE) / self.tile)

    def grid(self, width: int, height: int) -> tuple[int, int]:
        """(rows, cols) of the tiles a picture of this size is cut into (0 x 0: one tile, not split),
        from its size alone, so a header says it before a pixel is decoded. Raises InvalidArgument for
        an aspect ratio the resizes round to nothing."""
        return _grid(*self._sizes(height, width)[-1], self.tile)

    def resized_pixels(self, width: int, height: int) -> int:
        """The pixels the resizes make of a picture of this size (InvalidArgument as `grid`): each that
        changes its size (`_resize` skips one to its own size: a square picture's tile-multiple resize),
        then the global image's once it is split into a grid."""
        num_pixels, size = 0, (height, width)
        for resized in self._sizes(height, width):
            num_pixels += 0 if resized == size else resized[0] * resized[1]
            size = resized
        return num_pixels + (self.tile * self.tile if _grid(*size, self.tile) != (0, 0) else 0)

    def _sizes(self, height: int, width: int) -> list[tuple[int, int]]:
        """(height, width) after each resize, in order."""
        sizes = []
        if self.longest_edge is not None:
            height, width = _checked(width, height, *_longest_edge_size(height, width, self.longest_edge))
            sizes.append((height, width))
        if self.splitting:
            sizes.append(_checked(width, height, *_tile_multiple_size(height, width, self.tile)))
        else:
            sizes.append((self.tile, self.tile))
        return sizes

    def __call__(self, image: Image.Image) -> Tiles:
        image = rgb_for_processor(image, self.convert_rgb)
        for height, width in self._sizes(image.height, image.width):
            image = self._resize(image, height, width)
        frames = [image]
        rows, cols = _grid(image.height, image.width, self.tile)
        if (rows, cols) != (0, 0):
            frames = [
                image.crop((c * self.tile, r * self.tile, (c + 1) * self.tile, (r + 1) * self.tile))
                for r in range(rows)
                for c in range(cols)
            ]
            frames.append(self._resize(image, self.tile, self.tile))  # the global image
        return Tiles(torch.stack([self._to_tensor(frame) for frame in frames]), rows, cols)

    def _resize(self, image: Image.Image, height: int, width: int) -> Image.Image:
        if image.size == (width, height):
            return image  # PIL would copy it (6 ms at 2048 x 2048): the same pixels
        return image.resize((width, height), resample=self.resample)

    def _to_tensor(self, frame: Image.Image) -> torch.Tensor:
        """[3, tile, tile] float32: rescaled in float64, then float32 (as transformers), and normalized."""
        array = np.asarray(frame).transpose(2, 0, 1)  # [3, tile, tile] uint8
        return rescale_and_normalize(array, self.rescale_factor, self.mean, self.std)


def _grid(height: int, width: int, tile: int) -> tuple[int, int]:
    """(rows, cols) of tiles a resized picture is cut into; 0 x 0 when it is one tile."""
    if height > tile or width > tile:
        return height // tile, width // tile
    return 0, 0


def _checked(width: int, height: int, new_height: int, new_width: int) -> tuple[int, int]:
    """(new_height, new_width), the resize of a width x height picture, if neither side is 0."""
    if new_height < 1 or new_width < 1:
        # transformers fails here too (an extreme aspect ratio rounds a side down to 0).
        raise InvalidArgument(
            "image.data",
            f"{width} x {height} resizes to {new_width} x {new_height}: an aspect ratio too extreme",
        )
    return new_height, new_width


def _per_channel(value: Any) -> tuple[float, ...]:
    """A mean or std: one number for every channel, or three."""
    return tuple(float(v) for v in value) if isinstance(value, list | tuple) else (float(value),) * 3


def _longest_edge_size(height: int, width: int, longest_edge: int) -> tuple[int, int]:
    """transformers' get_resize_output_image_size: the longest edge to `longest_edge` (up or down), the
    other in proportion, truncated and rounded up to even; then both under MAX_IMAGE_SIZE."""
    aspect_ratio = width / height
    if width >= height:
        width = longest_edge
        height = int(width / aspect_ratio)
        height += height % 2
    else:
        height = longest_edge
        width = int(height * aspect_ratio)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    # Scale below the cap (aspect ratio of the resized image, as transformers computes it).
    aspect_ratio = width / height
    if width >= height and width > MAX_IMAGE_SIZE:
        width = MAX_IMAGE_SIZE
        height = int(width / aspect_ratio)
    elif height > width and height > MAX_IMAGE_SIZE:
        height = MAX_IMAGE_SIZE
        width = int(height * aspect_ratio)
    return max(height, 1), max(width, 1)


def _tile_multiple_size(height: int, width: int, tile: int) -> tuple[int, int]:
    """transformers' resize_for_vision_encoder: the longest side up to a multiple of the tile, the other
    in proportion to that, then up to a multiple of the tile too."""
    aspect_ratio = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect_ratio) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect_ratio) / tile) * tile
    return height, width
