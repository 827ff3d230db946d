"""An image's pixels as LLaVA's towers read them: equal to transformers' image processors' (the PIL
backend), for CLIP's resize-and-crop and SigLIP's fixed resize, whatever the picture's shape or mode."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from services.encoder.tests.resizes import record_resizes
from tandem.client.errors import InvalidArgument
from tandem.encoder.vision.preprocess import MAX_RESIZED_PIXELS, ImageProcessing

# (36, 36) and (36, 80) are resized to the size they have (a short side of 36, SigLIP's 36 x 36), which
# is skipped (PIL would copy it): the pixels must stay transformers'.
SIZES = [(53, 41), (30, 70), (336, 336), (7, 500), (1, 1), (36, 36), (36, 80)]
# The 8-bit modes, where transformers' conversion is faithful; 16-bit ones are test_rgb.py's.
MODES = ["RGB", "RGBA", "L", "P", "LA", "1", "PA", "CMYK", "YCbCr", "RGBX"]


def _picture(size: tuple[int, int], mode: str, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    rgba = Image.fromarray(rng.integers(0, 256, (size[1], size[0], 4), dtype=np.uint8), "RGBA")
    return rgba.convert(mode)


def _processors() -> dict[str, Any]:
    from transformers import CLIPImageProcessorPil, SiglipImageProcessorPil

    return {
        "clip": CLIPImageProcessorPil(size={"shortest_edge": 36}, crop_size={"height": 36, "width": 36}),
        "clip-224": CLIPImageProcessorPil(),  # the class defaults, as a terse preprocessor_config.json
        "siglip": SiglipImageProcessorPil(size={"height": 36, "width": 36}),
    }


@pytest.mark.parametrize("name", ["clip", "clip-224", "siglip"])
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("mode", MODES)
def test_pixels_equal_transformers_image_processor(name: str, size: tuple[int, int], mode: str) -> None:
    processor = _processors()[name]
    ours = ImageProcessing.from_hf(processor.to_dict(), ValueError)
    picture = _picture(size, mode)
    expected = processor(picture, return_tensors="pt")["pixel_values"][0]
    assert torch.equal(ours(picture), expected)


@pytest.mark.parametrize("name", ["clip", "siglip"])
def test_a_16_bit_grey_picture_is_scaled_where_transformers_clips_it_to_white(name: str) -> None:
    processor = _processors()[name]
    ours = ImageProcessing.from_hf(processor.to_dict(), ValueError)
    ramp = np.arange(36 * 36, dtype=np.uint16).reshape(36, 36) * 50  # 0 to 64,750
    picture = Image.fromarray(ramp)  # mode "I;16", as PIL opens a 16-bit grey PNG
    clipped = np.minimum(ramp, 255).astype(np.uint8)  # transformers' reading: 1,290 of 1,296 white
    assert (clipped == 255).sum() == 1290
    theirs = processor(picture, return_tensors="pt")["pixel_values"][0]
    assert torch.equal(theirs, processor(Image.fromarray(clipped), return_tensors="pt")["pixel_values"][0])
    high_bytes = Image.fromarray((ramp >> 8).astype(np.uint8))
    assert torch.equal(ours(picture), processor(high_bytes, return_tensors="pt")["pixel_values"][0])


@pytest.mark.parametrize(("name", "size"), [("clip", (36, 36)), ("clip", (36, 80)), ("siglip", (36, 36))])
def test_no_resize_to_the_size_a_picture_has_is_made(name: str, size: tuple[int, int], monkeypatch) -> None:
    ours = ImageProcessing.from_hf(_processors()[name].to_dict(), ValueError)
    resizes = record_resizes(monkeypatch)
    ours(_picture(size, "RGB"))
    assert resizes == []


def test_the_output_size_is_known_from_the_config() -> None:
    processors = _processors()
    assert ImageProcessing.from_hf(processors["clip"].to_dict(), ValueError).output_size() == (36, 36)
    assert ImageProcessing.from_hf(processors["clip-224"].to_dict(), ValueError).output_size() == (224, 224)
    assert ImageProcessing.from_hf(processors["siglip"].to_dict(), ValueError).output_size() == (36, 36)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"do_pad": True, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}, "do_pad is not supported"),
        ({"size": {"longest_edge": 30}, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}, "size"),
    ],
)
def test_a_step_we_cannot_reproduce_is_refused_by_name(config: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ImageProcessing.from_hf(config, ValueError)


@pytest.mark.parametrize("size", SIZES)
def test_the_resized_size_known_from_a_header_is_the_size_of_the_resized_picture(size) -> None:
    clip = ImageProcessing.from_hf({**_processors()["clip"].to_dict(), "do_center_crop": False}, ValueError)
    assert clip(_picture(size, "RGB")).shape[1:] == clip.resized_size(*size)[::-1]


def test_an_aspect_ratio_the_resize_would_blow_up_is_refused_from_the_size_alone() -> None:
    clip = ImageProcessing.from_hf(_processors()["clip"].to_dict(), ValueError)
    # 1 x 33,000,000 would become 36 x 1,188,000,000 before its crop.
    with pytest.raises(InvalidArgument, match="1 x 33000000 would be resized to 36 x 1188000000, over"):
        clip.resized_size(1, 33_000_000)
    thinnest = MAX_RESIZED_PIXELS // 36 // 36  # the longest side a 1-pixel-wide picture may have
    assert clip.resized_size(1, thinnest) == (36, 36 * thinnest)
    with pytest.raises(InvalidArgument, match="too extreme"):
        clip.resized_size(thinnest + 1, 1)
