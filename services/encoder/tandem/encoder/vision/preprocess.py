"""An image -> the pixel tensor a vision tower reads, as the checkpoint's `preprocessor_config.json` says.

The steps and their order are transformers' image processors' (the PIL backend, which needs no
torchvision): convert to RGB compositing transparency onto white (rgb.py, which also scales 16-bit
samples where transformers clips them to white), resize with PIL (shortest edge
kept in proportion, or a fixed height and width), crop the centre, rescale (x 1/255, in float64 as
numpy does, then float32), normalize with the per-channel mean and std. A setting we do not apply
(padding, aspect-ratio tricks) is refused at load time by name, never ignored: pixels that differ
from the training pipeline's give rows that mean something else.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from tandem.client.errors import InvalidArgument
from tandem.encoder.vision.rgb import rgb_for_processor

# A shortest-edge resize keeps the aspect ratio: a 20,000 x 1 picture (138 bytes of PNG, well within
# any pixel bound) would become 6,720,000 x 336 before its crop, 6.7 GB. Above this many pixels after
# the resize, the picture is refused (transformers' own processor fails on it too).
MAX_RESIZED_PIXELS = 32 * 1024 * 1024

# transformers' defaults for a preprocessor_config.json that leaves a step's switch out.
RESAMPLE_BY_PROCESSOR = {"CLIPImageProcessor": Image.Resampling.BICUBIC}


@dataclass(frozen=True)
class ImageProcessing:
    """The steps of one checkpoint's image processor."""

    shortest_edge: int | None  # resize so the short side is this long, keeping proportions
    height: int | None  # or resize to exactly height x width
    width: int | None
    resample: Image.Resampling
    crop: tuple[int, int] | None  # centre crop (height, width); None: no crop
    rescale_factor: float | None  # None: no rescale
    mean: tuple[float, ...] | None  # None: no normalization
    std: tuple[float, ...] | None
    convert_rgb: bool

    @classmethod
    def from_hf(cls, config: dict[str, Any], error: Callable[[str], Exception]) -> ImageProcessing:
        """From preprocessor_config.json. Raises `error(message)` for a step it cannot reproduce."""
        if config.get("do_pad"):
            raise error("preprocessor_config.json: do_pad is not supported")
        kind = config.get("image_processor_type", "").removesuffix("Fast").removesuffix("Pil")
        size = config.get("size") or {}
        shortest = height = width = None
        if config.get("do_resize", True):
            if isinstance(size, int):
                size = {"shortest_edge": size} if config.get("default_to_square") is False else {}
            shortest, height, width = size.get("shortest_edge"), size.get("height"), size.get("width")
            if shortest is None and (height is None or width is None):
                raise error(f"preprocessor_config.json: size {size!r} is not supported")
        crop = None
        if config.get("do_center_crop", False):
            crop_size = config.get("crop_size") or {}
            if isinstance(crop_size, int):
                crop_size = {"height": crop_size, "width": crop_size}
            crop = (int(crop_size["height"]), int(crop_size["width"]))
        resample = config.get("resample", RESAMPLE_BY_PROCESSOR.get(kind, Image.Resampling.BILINEAR))
        do_normalize = config.get("do_normalize", True)
        return cls(
            shortest_edge=shortest,
            height=height,
            width=width,
            resample=Image.Resampling(int(resample)),
            crop=crop,
            rescale_factor=float(config.get("rescale_factor", 1 / 255))
            if config.get("do_rescale", True)
            else None,
            mean=tuple(config["image_mean"]) if do_normalize else None,
            std=tuple(config["image_std"]) if do_normalize else None,
            convert_rgb=bool(config.get("do_convert_rgb", True)),
        )

    def output_size(self) -> tuple[int, int] | None:
        """(height, width) of every output, when fixed (a crop, or a fixed resize)."""
        if self.crop is not None:
            return self.crop
        if self.height is not None and self.width is not None and self.shortest_edge is None:
            return (self.height, self.width)
        return None

    def __call__(self, image: Image.Image) -> torch.Tensor:
        """[3, height, width] float32."""
        image = rgb_for_processor(image, self.convert_rgb)
        image = self._resize(image)
        pixels = np.asarray(image)  # [height, width, 3] uint8
        if self.crop is not None:
            pixels = _center_crop(pixels, *self.crop)
        return rescale_and_normalize(pixels.transpose(2, 0, 1), self.rescale_factor, self.mean, self.std)

    def resized_size(self, width: int, height: int) -> tuple[int, int] | None:
        """(width, height) a picture of this size is resized to; None: it is not resized. Raises
        InvalidArgument for one whose aspect ratio would blow the resize up: from the size alone, so a
        header says it before a pixel is decoded."""
        if self.shortest_edge is not None:
            short, long = (width, height) if width <= height else (height, width)
            new_long = int(self.shortest_edge * long / short)
            size = (self.shortest_edge, new_long) if width <= height else (new_long, self.shortest_edge)
        elif self.height is not None and self.width is not None:
            size = (self.width, self.height)
        else:
            return None
        if size[0] * size[1] > MAX_RESIZED_PIXELS:
            raise InvalidArgument(
                "image.data",
                f"{width} x {height} would be resized to {size[0]} x {size[1]}, over "
                f"{MAX_RESIZED_PIXELS} pixels: its aspect ratio is too extreme for this model's processor",
            )
        return size

    def _resize(self, image: Image.Image) -> Image.Image:
        size = self.resized_size(*image.size)
        # One to the size it has is skipped: PIL would copy it (`prepared_pixels` counts none).
        return image if size is None or size == image.size else image.resize(size, resample=self.resample)


def rescale_and_normalize(
    array: np.ndarray,  # [channels, height, width] uint8
    rescale_factor: float | None,
    mean: tuple[float, ...] | None,
    std: tuple[float, ...] | None,
) -> torch.Tensor:
    """[channels, height, width] float32 as transformers makes it: rescaled in float64 then cast to
    float32 (numpy's order), then normalized per channel in float32."""
    if rescale_factor is not None:
        array = (array.astype(np.float64) * rescale_factor).astype(np.float32)
    else:
        array = array.astype(np.float32)
    if mean is not None and std is not None:
        mean_column = np.asarray(mean, dtype=np.float32)[:, None, None]
        std_column = np.asarray(std, dtype=np.float32)[:, None, None]
        array = (array - mean_column) / std_column
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))


def _center_crop(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """[h, w, c] -> [height, width, c]; a side shorter than the crop is padded with zeros around it."""
    h, w = pixels.shape[:2]
    if h < height or w < width:
        padded = np.zeros((max(h, height), max(w, width), pixels.shape[2]), dtype=pixels.dtype)
        top, left = (padded.shape[0] - h + 1) // 2, (padded.shape[1] - w + 1) // 2
        padded[top : top + h, left : left + w] = pixels
        pixels, (h, w) = padded, padded.shape[:2]
    top, left = (h - height) // 2, (w - width) // 2
    return pixels[top : top + height, left : left + width]
