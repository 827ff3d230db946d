"""Untrusted image bytes -> a decoded picture, refusing what could hurt the server before decoding it.

In order, cheapest first: the byte count against max_image_bytes; the format, from the file's own
signature (PNG, JPEG or WebP only: no decoder for anything else is ever reached); the size, from the
header alone (PIL reads no pixel data when it opens a file), against max_image_pixels, so a small
file that claims 100,000 x 100,000 pixels (a decompression bomb) is refused before a byte of it is
inflated; then the decode, whose every failure is INVALID_ARGUMENT naming the field. An animated
file gives its first frame.
"""

from __future__ import annotations

import io
import threading
import warnings

from PIL import Image, UnidentifiedImageError

from tandem.client.errors import InvalidArgument

FORMATS = ("PNG", "JPEG", "WEBP")
_UNBOUNDED = threading.Lock()  # PIL's bound is a module global: one opener at a time lifts it


def sniff_format(data: bytes) -> str | None:
    """PNG, JPEG or WEBP from the file signature; None for anything else."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if data.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if len(data) >= 12 and data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    return None


def decode_image(data: bytes, max_bytes: int, max_pixels: int, field: str = "image.data") -> Image.Image:
    """The decoded picture (its first frame). Raises InvalidArgument naming `field`."""
    if not data:
        raise InvalidArgument(field, "is empty; send PNG, JPEG or WebP bytes")
    if len(data) > max_bytes:
        raise InvalidArgument(field, f"{len(data)} bytes exceed max_image_bytes {max_bytes}")
    image_format = sniff_format(data)
    if image_format is None:
        raise InvalidArgument(field, "is not a PNG, JPEG or WebP image (read from its first bytes)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = _open_header(data, image_format)
            width, height = image.size
            if width < 1 or height < 1:
                raise InvalidArgument(field, f"has no pixels ({width} x {height})")
            if width * height > max_pixels:
                raise InvalidArgument(
                    field,
                    f"{width} x {height} = {width * height} pixels exceed max_image_pixels {max_pixels}",
                )
            image.load()
    except InvalidArgument:
        raise
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, EOFError, Warning) as e:
        raise InvalidArgument(field, f"cannot be decoded as {image_format}: {e}") from None
    return image


def _open_header(data: bytes, image_format: str) -> Image.Image:
    """The file opened (its header read, no pixel decoded), with PIL's own pixel bound lifted: ours,
    max_image_pixels, is checked right after, with its own message (PIL's fires at open, at its
    limit, which is not the operator's)."""
    with _UNBOUNDED:
        bound, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, None
        try:
            return Image.open(io.BytesIO(data), formats=[image_format])
        finally:
            Image.MAX_IMAGE_PIXELS = bound
