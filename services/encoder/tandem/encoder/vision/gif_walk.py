"""A GIF's bytes before its first image, walked as PIL reads them (GifImageFile._seek, PIL 13), read for
read: for `image_bytes` to bound the reads PIL makes in Python, and for `declared_size` to find the
image descriptor PIL will use. One walk for both: two walkers that disagree let a file show one of
them a small frame and PIL another (a descriptor hidden in the sub-blocks PIL reads past an empty
first one)."""

from __future__ import annotations


def walk_to_first_image(data: bytes, max_blocks: int) -> tuple[int, int]:
    """(the reads PIL makes before the first image, where the walk stopped): at the first image's
    descriptor (data[i] == 0x2C), the trailer (0x3B), the end of `data`, or once the reads pass
    `max_blocks`. A read is each extension, each sub-block (1 to 255 bytes) and each stray byte (any
    other than an extension's '!', an image's ',' or the trailer's ';', which PIL skips a byte at a
    time). The frame's own data PIL's decoder reads in C, and no other frame is read."""
    if len(data) < 13:
        return 0, len(data)
    packed = data[10]  # the logical screen's: a global colour table of 2^(n+1) colours follows
    i = 13 + (3 << ((packed & 7) + 1) if packed & 0x80 else 0)
    blocks = 0
    while blocks <= max_blocks and i < len(data) and data[i] not in (0x2C, 0x3B):  # an image; the end
        blocks += 1
        introducer, label = data[i], data[i + 1 : i + 2]
        i += 1
        if introducer != 0x21:  # a stray byte
            continue
        i += 1
        first = data[i + 1 : i + 1 + data[i]] if i < len(data) else b""
        i += 1 + len(first)  # PIL reads the first sub-block whatever the label
        blocks += bool(first)
        if label == b"\xfe" and not first:  # an empty comment ends there
            continue
        if label == b"\xff" and first.startswith(b"NETSCAPE2.0") and i < len(data):
            blocks += data[i] != 0  # its loop count: one read more, empty or not
            i += 1 + data[i]
        # Then on to the next empty sub-block, even when the first read was the empty one ending the
        # extension (PIL's `while self.data()` after it): the sub-blocks past it are read too.
        while blocks <= max_blocks and i < len(data) and data[i] != 0:
            blocks += 1
            i += 1 + data[i]
        i += 1
    return blocks, i
