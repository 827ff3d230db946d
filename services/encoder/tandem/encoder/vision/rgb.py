"""A decoded picture of any pixel mode PIL hands us -> the 8-bit RGB a vision tower's processor reads.

NOTE: transformers' `convert_rgb` (its image processors' first step) is `image.convert("RGBA")`
composited onto white. For 8-bit modes that is right, and `to_rgb` gives the same pixels. For a
16-bit grey PNG, which PIL opens as mode "I;16", it is not: PIL's convert clips each sample to 255
instead of scaling it, so every sample of 255 or more (all but the darkest 0.4% of the range) comes
out white, and a 16-bit grey photo is a white page. Here 16-bit samples are scaled to 8 bits as
`v >> 8`, the high byte: the same reduction PIL applies to a 16-bit RGB, RGBA or grey-alpha PNG (so
one picture saved at 16 bits as grey or as RGB gives the same pixels) and libpng's
`png_set_strip_16`. The alternatives differ from it by at most 1 in a sample (on 16,256 of the 65,536
values): libpng's `png_set_scale_16` rounds `v / 257`, ImageMagick 6.9.11 (Q16) floors it.

The modes the accepted formats decode to (Pillow 13): PNG gives "1", "L", "LA", "P", "RGB", "RGBA" and
"I;16" (16-bit grey; 16-bit RGB, RGBA and grey-alpha come out as 8-bit "RGB" and "RGBA"), "1", "L",
"P", "RGB" and "I;16" with a transparent colour in `info["transparency"]`; JPEG "L", "RGB" and "CMYK";
WebP "RGB" and "RGBA"; GIF's first frame "P" or "L". A caller holding a PIL image may bring others:
the rest of the 16-bit family ("I;16B", "I;16L", "I;16N"), "I" (32-bit integers: older Pillow opened
a 16-bit grey PNG so, and they are taken as 16-bit samples; a value outside 0..65535 is refused, as
no scale is agreed for it), the premultiplied "La" and "RGBa", "PA", "RGBX" and "YCbCr". Anything else
("F" floating point, which has no agreed range; "HSV", "LAB") is refused by name, never guessed.
"""

from __future__ import annotations

import numpy as np
from PIL import Image

from tandem.client.errors import InvalidArgument

# Modes whose samples PIL's own convert takes to RGB faithfully: 1- and 8-bit samples, a palette, or
# a colour space it converts by formula (CMYK, YCbCr).
_PIL_CONVERTS = frozenset({"1", "L", "LA", "La", "P", "PA", "RGB", "RGBA", "RGBa", "RGBX", "CMYK", "YCbCr"})
# Modes with an alpha band ("A", or "a" premultiplied). LAB's "A" band is a colour axis, not alpha,
# so a mode's bands do not say it.
_ALPHA = frozenset({"LA", "La", "PA", "RGBA", "RGBa"})
# One grey band of 16-bit samples, in any byte order; "I" (32-bit) is taken as one when its values fit.
_SIXTEEN_BIT = frozenset({"I;16", "I;16B", "I;16L", "I;16N", "I"})
MAX_SIXTEEN_BIT = 65_535


def to_rgb(image: Image.Image, field: str = "image.data") -> Image.Image:
    """RGB, 8 bits a sample: 16-bit samples scaled by their high byte, any transparency (an alpha band
    or a transparent colour) composited onto white (as transformers does). Raises InvalidArgument
    naming `field` and the mode for a mode with no faithful conversion."""
    if image.mode in _SIXTEEN_BIT:
        image = _sixteen_to_eight_bits(image, field)
    elif image.mode not in _PIL_CONVERTS:
        raise InvalidArgument(field, f"has pixel mode {image.mode!r}, {_WHY_NOT.get(image.mode, _NO_RULE)}")
    if image.mode == "La":  # premultiplied: PIL converts it to LA alone
        image = image.convert("LA")
    if image.mode in _ALPHA or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image if image.mode == "RGB" else image.convert("RGB")


def rgb_for_processor(image: Image.Image, convert_rgb: bool, field: str = "image.data") -> Image.Image:
    """What a checkpoint's processor reads: `to_rgb(image)` when its config converts (do_convert_rgb,
    the default), else the picture itself, which must then be RGB: transformers would read another
    mode's bands as they are (a grey picture's one band against three channels' means, a 16-bit one's
    samples up to 65,535 as if up to 255), so one is refused naming its mode."""
    if convert_rgb:
        return to_rgb(image, field)
    if image.mode != "RGB":
        raise InvalidArgument(
            field, f"image mode {image.mode!r} is not RGB, and this model's processor converts none"
        )
    return image


_NO_RULE = "which the encoder does not convert to RGB (a PNG, JPEG, WebP or GIF decodes to none)"
_WHY_NOT = {
    "F": "floating-point samples, whose range no format agrees on, so no scale to 8 bits is taken",
}


def _sixteen_to_eight_bits(image: Image.Image, field: str) -> Image.Image:
    """One grey band of 16-bit samples -> "L", their high bytes; "LA" when a sample value is the
    transparent one (`info["transparency"]`, compared at 16 bits, exactly as the file gave it)."""
    samples = np.asarray(image)  # [height, width] uint16 (">u2" for I;16B, int32 for I)
    if image.mode == "I" and samples.size and (samples.min() < 0 or samples.max() > MAX_SIXTEEN_BIT):
        raise InvalidArgument(
            field,
            f"has pixel mode 'I' (32-bit integers) with values from {samples.min()} to {samples.max()}: "
            f"taken as 16-bit samples, they must lie within 0..{MAX_SIXTEEN_BIT}",
        )
    grey = Image.fromarray((samples >> 8).astype(np.uint8))  # [height, width] "L"
    key = image.info.get("transparency")
    if isinstance(key, int):
        alpha = np.where(samples == key, 0, 255).astype(np.uint8)  # [height, width]
        return Image.merge("LA", (grey, Image.fromarray(alpha)))
    return grey
