"""The width and height an image file's header declares, read from fixed places in its first bytes,
for the event loop to weigh a call before it queues (`Batcher`'s cost): no PIL, no decoding, at most
a few dozen JPEG segment headers stepped over (microseconds).

An estimate, not a rule: a file that lies or is cut gets what its bytes say, or None, and its decode
(`image_bytes.decode_image`) still checks everything on the image thread.
"""

from __future__ import annotations

# The JPEG segments stepped over looking for the frame header (SOFn): a camera's header has a dozen
# (APPn metadata, tables); past this the file is weighed as unknown.
MAX_JPEG_SEGMENTS = 64
# Start-of-frame markers: every SOFn but DHT (C4), JPG (C8) and DAC (CC).
_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}


def declared_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) as the header of a PNG, GIF, WebP or JPEG declares it; None where it says none."""
    if data.startswith(b"\x89PNG\r\n\x1a\n") and data[12:16] == b"IHDR" and len(data) >= 24:
        return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    if data.startswith((b"GIF87a", b"GIF89a")) and len(data) >= 10:
        return int.from_bytes(data[6:8], "little"), int.from_bytes(data[8:10], "little")
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


def _jpeg_size(data: bytes) -> tuple[int, int] | None:
    i = 2
    for _ in range(MAX_JPEG_SEGMENTS):
        while i < len(data) and data[i] == 0xFF and i + 1 < len(data) and data[i + 1] == 0xFF:
            i += 1  # fill bytes
        if i + 4 > len(data) or data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker in _SOF:
            if i + 9 > len(data):
                return None
            return int.from_bytes(data[i + 7 : i + 9], "big"), int.from_bytes(data[i + 5 : i + 7], "big")
        if marker == 0xDA or marker == 0xD9:  # a scan or the end before any frame header
            return None
        i += 2 + int.from_bytes(data[i + 2 : i + 4], "big")
    return None
