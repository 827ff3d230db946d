"""The size an image's header declares, read without PIL: what PIL reads for each format, None where
the bytes say none."""

from __future__ import annotations

import io
import struct

import pytest
from PIL import Image

from tandem.encoder.vision.declared_size import (
    MAX_GIF_BLOCKS,
    MAX_JPEG_FILL_BYTES,
    MAX_JPEG_SEGMENTS,
    declared_size,
)


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


def _with_screen(gif: bytes, width: int, height: int) -> bytes:
    return gif[:6] + struct.pack("<HH", width, height) + gif[10:]


def test_a_gif_declares_its_first_frame_where_that_outgrows_its_screen() -> None:
    # PIL enlarges the picture to the frame: a screen of 1 x 1 once ranked a frame of 5,792 x 5,792 as a
    # pixel. Behind a comment of three sub-blocks too.
    for options in ({}, {"comment": b"c" * 600}):
        gif = _with_screen(_file((37, 21), "GIF", **options), 1, 1)
        assert declared_size(gif) == Image.open(io.BytesIO(gif)).size == (37, 21)
    assert declared_size(_with_screen(_file((37, 21), "GIF"), 50, 9)) == (50, 21)  # the larger, each side


def test_a_gif_frame_is_the_one_pil_reads_not_a_descriptor_hidden_in_sub_blocks_it_reads_past() -> None:
    # An extension whose first sub-block is empty: PIL reads on past that zero to the next one, so a
    # ',' there is a sub-block's length to PIL. A walker that stopped at the zero read it as the frame
    # (0 x 0), ranking a 300 x 200 frame behind it as the 1 x 1 screen.
    gif = _with_screen(_file((300, 200), "GIF"), 1, 1)
    frame = 13 + 3 * 2 ** ((gif[10] & 7) + 1)  # past the global colour table: the blocks start there
    hidden = b"\x2c" + bytes(8) + b"\x01" * 36 + b"\x00"  # 44 bytes after the ',': one sub-block to PIL
    for extension in (b"\x21\xf9\x00", b"\x21\x01\x00", b"\x21\xff\x0bNETSCAPE2.0\x00"):
        crafted = gif[:frame] + extension + hidden + gif[frame:]
        assert declared_size(crafted) == Image.open(io.BytesIO(crafted)).size == (300, 200), extension


def test_a_gif_whose_first_frame_is_not_found_soon_declares_none() -> None:
    gif = _file((8, 8), "GIF")
    comments = b"\x21\xfe" + b"\x01c" * MAX_GIF_BLOCKS + b"\x00"  # the frame past the walk
    # The header alone, a cut extension, a trailer before any frame.
    for data in (gif[:13], gif[:13] + b"\x21\xfe\x05ab", gif[:13] + b"\x3b"):
        assert declared_size(data) is None
    assert declared_size(gif[:13] + comments + gif[13:]) is None
    stray = gif[:13] + b"\x00" + gif[13:]  # PIL skips a stray byte and reads on: so does the walk
    assert declared_size(stray) == Image.open(io.BytesIO(stray)).size == (8, 8)


def test_jpeg_markers_with_no_length_or_stray_bytes_declare_none() -> None:
    # A restart marker has no length: reading one (FF E1 of the APP1 after it) as a length once landed the
    # walk inside that APP1, on a frame header of 1 x 1 hidden there, ahead of the real 8 x 8 one.
    jpeg = _file((8, 8), "JPEG")
    payload = bytearray(65531)
    payload[65501:65512] = bytes.fromhex("ffc0000b08000100010111")
    hidden = jpeg[:2] + b"\xff\xd0\xff\xe1" + struct.pack(">H", 65533) + bytes(payload) + jpeg[2:]
    for data in (
        hidden,
        jpeg[:2] + b"\xff\x01" + jpeg[2:],  # TEM
        jpeg[:2] + b"\x00" + jpeg[2:],  # a stray byte
        jpeg[:2] + b"\xff\xe1\x00\x01" + jpeg[2:],  # a length shorter than itself
        jpeg[:2] + b"\xff" * MAX_JPEG_FILL_BYTES + jpeg[2:],  # too much fill
    ):
        assert declared_size(data) is None


def test_jpeg_fill_bytes_before_a_marker_are_stepped_over_as_pil_does() -> None:
    jpeg = _file((37, 21), "JPEG")
    filled = jpeg[:2] + b"\xff" * 5 + jpeg[2:]
    assert declared_size(filled) == Image.open(io.BytesIO(filled)).size == (37, 21)
