"""The size an image's header declares, read without PIL: what PIL reads for each format, None where
the bytes say none."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from tandem.encoder.vision.declared_size import MAX_JPEG_SEGMENTS, declared_size


def _file(size: tuple[int, int], fmt: str, **options: object) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, (9, 90, 200)).save(out, fmt, **options)
    return out.getvalue()


@pytest.mark.parametrize(
    ("fmt", "options"),
    [
        ("PNG", {}),
        ("GIF", {}),
        ("JPEG", {"exif": Image.Exif().tobytes()}),
        ("JPEG", {"progressive": True}),
        ("WEBP", {"lossless": True}),  # VP8L
        ("WEBP", {"quality": 80}),  # VP8
        ("WEBP", {"exif": b"Exif\x00\x00II*\x00\x08\x00\x00\x00\x00\x00"}),  # VP8X
    ],
)
def test_each_format_declares_the_size_pil_reads(fmt: str, options: dict) -> None:
    data = _file((37, 21), fmt, **options)
    assert declared_size(data) == Image.open(io.BytesIO(data)).size == (37, 21)


def test_bytes_that_declare_no_size_give_none() -> None:
    jpeg = _file((8, 8), "JPEG")
    padded = jpeg[:2] + b"\xff\xe5\x00\x02" * MAX_JPEG_SEGMENTS + jpeg[2:]  # the frame header past the walk
    for data in (
        b"",
        b"not an image",
        b"\x89PNG\r\n\x1a\n",
        jpeg[:20],
        padded,
        b"RIFF\0\0\0\0WEBPVP8?" + bytes(20),
    ):
        assert declared_size(data) is None
