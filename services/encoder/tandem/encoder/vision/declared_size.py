"""The width and height an image file's header declares, read from fixed places in its first bytes,
for the event loop to weigh a call before it queues (`Batcher`'s cost): no PIL, no decoding, at most
a few dozen JPEG segment headers or a few hundred GIF blocks stepped over (microseconds).

An estimate, not a rule: a file that lies or is cut gets what its bytes say, or None, and its decode
(`image_bytes.decode_image`) still checks everything on the image thread.
"""

from __future__ import annotations

from tandem.encoder.vision.gif_walk import walk_to_first_image

# The JPEG segments stepped over looking for the frame header (SOFn): a camera's header has a dozen
# (APPn metadata, tables); past this the file is weighed as unknown.
MAX_JPEG_SEGMENTS = 64
# Start-of-frame markers: every SOFn but DHT (C4), JPG (C8) and DAC (CC).
_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
# The other markers a length follows, to be stepped over: DHT, JPG, DAC, DQT, DNL, DRI, DHP, EXP, APPn,
# JPGn and COM. Any other (a restart marker, TEM, SOI, a scan) has no length: reading one there would
# land the walk inside a segment, where a crafted APP1 could hold a fake frame header.
_SKIPPED = frozenset({0xC4, 0xC8, 0xCC, *range(0xDB, 0xFF)})
# Fill bytes (0xFF) allowed before a JPEG marker: PIL skips them; more, and the file is weighed as unknown.
MAX_JPEG_FILL_BYTES = 64
# The GIF blocks (extensions' sub-blocks included) stepped over looking for the first frame's image
# descriptor; past this the file is weighed as unknown.
MAX_GIF_BLOCKS = 256


def declared_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) as the header of a PNG, GIF, WebP or JPEG declares it; None where it says none."""
    if data.startswith(b"\x89PNG\r\n\x1a\n") and data[12:16] == b"IHDR" and len(data) >= 24:
        return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    if data.startswith((b"GIF87a", b"GIF89a")) and len(data) >= 13:
        return _gif_size(data)
    if len(data) >= 30 and data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return _webp_size(data)
    if data.startswith(b"\xff\xd8"):
        return _jpeg_size(data)
    return None


def _webp_size(data: bytes) -> tuple[int, int] | None:
    kind = data[12:16]
    if kind == b"VP8X":  # the canvas, 24 bits a side, minus one
        return int.from_bytes(data[24:27], "little") + 1, int.from_bytes(data[27:30], "little") + 1
    if kind == b"VP8L" and data[20] == 0x2F:  # 14 bits a side, minus one, after the signature byte
        bits = int.from_bytes(data[21:25], "little")
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if kind == b"VP8 ":  # a key frame's 14-bit sides after its start code
        return int.from_bytes(data[26:28], "little") & 0x3FFF, int.from_bytes(data[28:30], "little") & 0x3FFF
    return None


def _gif_size(data: bytes) -> tuple[int, int] | None:
    """The larger of the logical screen and the first frame's extent: PIL enlarges the picture to a
    frame past the screen, so a screen of 1 x 1 may hold a frame of 5,792 x 5,792. The frame is the one
    PIL finds, walking as it reads (`gif_walk`)."""
    width, height = int.from_bytes(data[6:8], "little"), int.from_bytes(data[8:10], "little")
    blocks, i = walk_to_first_image(data, MAX_GIF_BLOCKS)
    if blocks > MAX_GIF_BLOCKS or i + 9 > len(data) or data[i] != 0x2C:  # too far, cut, or no image
        return None
    left, top, frame_w, frame_h = (int.from_bytes(data[j : j + 2], "little") for j in range(i + 1, i + 9, 2))
    return max(width, left + frame_w), max(height, top + frame_h)


def _jpeg_size(data: bytes) -> tuple[int, int] | None:
    i = 2
    for _ in range(MAX_JPEG_SEGMENTS):
        if data[i : i + 1] != b"\xff":  # a stray byte where a marker belongs
            return None
        fill = data[i + 1 : i + 1 + MAX_JPEG_FILL_BYTES]
        num_fill = len(fill) - len(fill.lstrip(b"\xff"))
        if num_fill == MAX_JPEG_FILL_BYTES:
            return None
        i += num_fill
        if i + 4 > len(data):
            return None
        marker = data[i + 1]
        if marker in _SOF:
            if i + 9 > len(data):
                return None
            return int.from_bytes(data[i + 7 : i + 9], "big"), int.from_bytes(data[i + 5 : i + 7], "big")
        if marker not in _SKIPPED:  # no length follows (or a scan, or the end, before any frame header)
            return None
        length = int.from_bytes(data[i + 2 : i + 4], "big")
        if length < 2:  # a length counts its own two bytes
            return None
        i += 2 + length
    return None
