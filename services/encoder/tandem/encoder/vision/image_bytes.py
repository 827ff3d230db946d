"""Untrusted image bytes -> a decoded picture, refusing what could hurt the server before decoding it.

In order, cheapest first: the byte count against max_image_bytes; the format, from the file's own
signature (PNG, JPEG, WebP or GIF only: no decoder for anything else is ever reached); a JPEG's
scans, counted from its markers (a progressive JPEG has about 10; one of 2,000 tiny scans took 4 s to
decode, and 20 MiB holds 277,000), a PNG's chunks, a JPEG's segments (in its header, with the bytes
between them and its Photoshop resource blocks) or the blocks before a GIF's first frame (MAX_CHUNKS
says why) and a PNG's colour profiles (one, as its spec says: PIL inflates each);
the size, from the header alone (PIL reads no pixel data when it opens a file), against
max_image_pixels, so a small file that claims 100,000 x 100,000 pixels (a
decompression bomb) is refused before a byte of it is inflated, and so is a side over JPEG's 65,535
pixels (MAX_IMAGE_SIDE says why); then the caller's rules on that size
(`check_size`: the resize the model's processor implies, the span's length), so a 1 x 33,000,000
PNG that the resize would blow up costs nothing either; then the decode, whose every failure is
INVALID_ARGUMENT naming the field. An animated file gives its first frame: PIL reads no further (a GIF
of 200,000 frames opens as fast as one of one), and telling an animated GIF from a still one would
mean walking every frame's data, in sub-blocks of up to 255 bytes, in Python.

A picture is taken as it is shown: its EXIF orientation (a phone's portrait photo is stored sideways,
tagged "rotate 90") is read from the header with its size (a PNG's from its eXIf chunk, even one
after the pixels) and applied once decoded, as browsers, transformers' `load_image` and vLLM do;
every size rule sees the shown size.
"""

from __future__ import annotations

import io
import re
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass

from PIL import ExifTags, Image, UnidentifiedImageError

from tandem.client import error_reasons as reasons
from tandem.client.errors import ErrorInfo, InvalidArgument
from tandem.encoder.vision.gif_walk import walk_to_first_image

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
MAX_JPEG_SCANS = 32
# The chunks of a PNG and the segments of a JPEG (tables, metadata, comments): PIL reads each in
# Python before any size rule, about 4 and 2 us apiece, so an 18 MiB PNG of 1.6 million empty
# ancillary chunks took 6.2 s and +185 MB, a 19 MiB JPEG of 5 million empty APP5 segments 9.6 s and
# +658 MB, each holding the image thread and the GIL. A real file has a few dozen; a PNG up to a few
# thousand (libpng writes IDAT in 8 KiB chunks, 2,560 in 20 MiB; an APNG two a frame). A GIF's
# extensions before its first frame are read the same way, a sub-block (1 to 255 bytes) at a time: 1
# million of them took 0.3 s, and 20 MiB holds 10 million; a real GIF has a handful. So is each
# stray byte between them, which PIL skips one read at a time (20 MB: 1.5 s). The walk that counts
# them stops past the bound.
MAX_CHUNKS = 65_536
# The longest side taken, JPEG's own limit. PIL's resize keeps a table of filter weights of about 6
# doubles per pixel of the side it shrinks: a 4 KB PNG of 33,554,432 x 1 (within max_image_pixels)
# made that table 1.6 GB and held the GIL 4.75 s (SmolVLM's longest-edge resize), stalling every call
# of the encoder; at this bound the table is 3 MB.
MAX_IMAGE_SIDE = 65_535
MAX_PALETTE_ENTRIES = 256  # a PNG palette's entries, so its tRNS alphas, at most (the PNG spec)
_BOUND = threading.Lock()  # PIL's pixel bound is a module global: one opener at a time sets it
_PIL_PIXELS = re.compile(r"\((\d+) pixels\)")
# The process's warning filters for PIL (`_filter_pil_warnings`), first to last.
_PIL_FILTERS = [
    ("error", None, Image.DecompressionBombWarning, None, 0),
    ("ignore", None, UserWarning, re.compile(r"PIL\."), 0),
]
# A JPEG marker that starts a segment: the last 0xFF of a run (the others are fill) then neither a
# stuffed 0x00 nor a restart marker, found at C speed (a walk in Python spent 1.75 s on 9.5 MiB of
# restart markers). Two bytes, no repeat: with the run in the pattern (\xff+) a run with no marker
# after it was matched again from each of its bytes, 22 s for 64 KiB of 0xFF closing a cut file.
_JPEG_MARKER = re.compile(rb"\xff[^\x00\xd0-\xd7\xff]")
# EXIF orientation -> the transposition that shows the picture upright (PIL's ImageOps.exif_transpose).
_UPRIGHT = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}
_SWAPS_SIDES = (5, 6, 7, 8)
# The first characters of each format's signature in base64 (a JPEG's "/9j/" is "_9j_" in the URL-safe
# alphabet; the others read the same in both), and what a pasted string may bring before it (none is a
# picture's first byte).
_BASE64_STARTS = {b"iVBORw0KGgo": "PNG", b"/9j/": "JPEG", b"_9j_": "JPEG", b"UklGR": "WebP", b"R0lGOD": "GIF"}
_PASTED_BEFORE = b" \t\r\n\"'\xef\xbb\xbf"


def sniff_format(data: bytes) -> str | None:
    """PNG, JPEG, WEBP or GIF from the file signature; None for anything else."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if data.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if len(data) >= 12 and data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    if data.startswith((b"GIF87a", b"GIF89a")):
        return "GIF"
    return None


def image_too_large(num_bytes: int, max_bytes: int) -> ErrorInfo:
    """The refusal's reason for programs (the gateway's 413), whichever wording the message has."""
    numbers = {reasons.IMAGE_BYTES: num_bytes, reasons.MAX_IMAGE_BYTES: max_bytes}
    return reasons.info_of(reasons.ENCODER, reasons.IMAGE_TOO_LARGE, numbers)


def check_image_bytes(data: bytes, max_bytes: int, field: str = "image.data") -> str:
    """The picture's format (`sniff_format`) once its bytes pass the checks that cost microseconds: not
    empty, at most max_bytes, a PNG, JPEG, WebP or GIF by its first bytes. The servicer runs them before
    a call is queued: bytes that declare no size are weighed as the largest picture, so a data: URL
    refused on the image thread was answered 2 s late behind 39 pictures. Raises InvalidArgument naming
    `field`, and saying so when the bytes are a picture sent as text."""
    if not data:
        raise InvalidArgument(field, "is empty; send PNG, JPEG, WebP or GIF bytes")
    if len(data) > max_bytes:
        as_text = sent_as_text(data)  # base64 is 4/3 of the bytes: those may fit
        raise InvalidArgument(
            field,
            f"{len(data)} bytes exceed max_image_bytes {max_bytes}"
            + (f", and it {as_text}" if as_text else ""),
            info=image_too_large(len(data), max_bytes),
        )
    image_format = sniff_format(data)
    if image_format is None:
        raise InvalidArgument(
            field, sent_as_text(data) or "is not a PNG, JPEG, WebP or GIF image (read from its first bytes)"
        )
    return image_format


def sent_as_text(data: bytes) -> str | None:
    """What a picture sent as text is (a data: URL, base64, an http(s) URL, the OpenAI image_url part as
    JSON), read past what a paste brings before it (whitespace, a byte-order mark, a JSON string's
    quote); None for other bytes. Reads the first 64 bytes only: `data` may be just those."""
    head = data[:64].lstrip(_PASTED_BEFORE)
    if head[:5].lower() == b"data:":
        return "is a data: URL, not a picture's bytes; send the PNG, JPEG, WebP or GIF bytes it encodes"
    if head[:8].lower().startswith((b"http://", b"https://")):  # a direct gRPC caller's picture address
        return "is a URL, not a picture's bytes; send the picture's bytes (the encoder fetches no URL)"
    if head.startswith(b"{") and (b'"url"' in head or b'"image_url"' in head):  # the OpenAI part, pasted
        return "is JSON (an OpenAI image_url part?), not a picture's bytes; send the picture's bytes"
    name = next((name for start, name in _BASE64_STARTS.items() if head.startswith(start)), None)
    return (
        None
        if name is None
        else f"looks like base64 of a {name} image, not its bytes; send the bytes it decodes to"
    )


def decode_image(
    data: bytes,
    max_bytes: int,
    max_pixels: int,
    field: str = "image.data",
    check_size: Callable[[int, int], None] = lambda width, height: None,
) -> Image.Image:
    """The decoded picture (its first frame). `check_size(width, height)` runs on the header's size
    after the pixel bound and before decoding: every other rule that follows from the size (the
    resize a processor implies, the span's length) refuses there, at no cost. Raises InvalidArgument
    naming `field`."""
    image_format = check_image_bytes(data, max_bytes, field)
    late_exif = None  # a PNG's eXIf chunk after its pixels, which PIL reads only with them
    png_bit_depth = None  # a PNG's bits a sample, from its IHDR
    png_grey_key = None  # a PNG's tRNS grey sample as written
    if image_format == "JPEG":
        jpeg = jpeg_segments(data)
        if jpeg.num_scans > MAX_JPEG_SCANS:
            raise InvalidArgument(
                field, f"a JPEG of over {MAX_JPEG_SCANS} scans; at most {MAX_JPEG_SCANS} are decoded"
            )
        if jpeg.num_reads > MAX_CHUNKS:
            raise InvalidArgument(
                field,
                f"a JPEG of over {MAX_CHUNKS} segments, Photoshop resource blocks and stray header bytes "
                f"({jpeg.num_segments}, {jpeg.num_resource_blocks} and {jpeg.num_stray_bytes} when the "
                f"count stopped); at most {MAX_CHUNKS} are read",
            )
    if image_format == "PNG":
        png = png_chunks(data)
        if png.num_chunks > MAX_CHUNKS:
            raise InvalidArgument(field, f"a PNG of over {MAX_CHUNKS} chunks; at most {MAX_CHUNKS} are read")
        if png.num_profiles > 1:
            # PIL inflates each (up to 1 MB) and keeps the last: 19,000 of 1 KB each, in 18 MiB,
            # took 42 s of the image thread.
            raise InvalidArgument(field, f"a PNG of {png.num_profiles} iCCP chunks; the PNG spec allows one")
        if png.size is None or png.num_headers != 1:
            # libpng refuses both; PIL reads a later IHDR too and decodes by the last it read, where the
            # transparent colour's scale (`_match_transparent_colour`) would be read from the first:
            # a 16-bit header before an 8-bit one turned every pixel of a picture white.
            found = "none first" if png.size is None else f"{png.num_headers}"
            raise InvalidArgument(field, f"a PNG must begin with its one IHDR chunk (the PNG spec); {found}")
        late_exif = png.exif
        png_bit_depth = png.bit_depth
        png_grey_key = png.grey_key
        if png.size is not None and 0 in png.size:  # PIL refuses it as "not a PNG": say what it is
            raise InvalidArgument(field, f"has no pixels ({png.size[0]} x {png.size[1]})")
        if png.metadata:
            data = _without(data, png.metadata)
    if image_format == "GIF" and gif_blocks(data) > MAX_CHUNKS:
        raise InvalidArgument(
            field,
            f"a GIF of over {MAX_CHUNKS} blocks and sub-blocks before its first frame; at most "
            f"{MAX_CHUNKS} are read",
        )
    try:
        image = _open_header(data, image_format, max_pixels)
        orientation = _orientation(image, late_exif)
        width, height = image.size[::-1] if orientation in _SWAPS_SIDES else image.size
        if width < 1 or height < 1:
            raise InvalidArgument(field, f"has no pixels ({width} x {height})")
        if width * height > max_pixels:
            raise InvalidArgument(
                field,
                f"{width} x {height} = {width * height} pixels exceed max_image_pixels {max_pixels}",
            )
        if max(width, height) > MAX_IMAGE_SIDE:
            raise InvalidArgument(
                field, f"{width} x {height}: a side over {MAX_IMAGE_SIDE} pixels (JPEG's own limit)"
            )
        check_size(width, height)
        image.load()
        if png_bit_depth is not None:
            _check_palette_transparency(image, field)
            _match_transparent_colour(image, png_bit_depth, png_grey_key)
        if orientation in _UPRIGHT:
            image = image.transpose(_UPRIGHT[orientation])
    except InvalidArgument:
        raise
    except (Image.DecompressionBombWarning, Image.DecompressionBombError) as e:
        claimed = _PIL_PIXELS.search(str(e))
        pixels = f"{claimed.group(1)} pixels" if claimed else "more pixels"
        raise InvalidArgument(
            field, f"its header claims {pixels}, over max_image_pixels {max_pixels}"
        ) from None
    except UnidentifiedImageError:  # PIL's words name its buffer's address: the same words each time
        raise InvalidArgument(field, f"cannot be decoded as {image_format}: its header is not one") from None
    except (OSError, SyntaxError, ValueError, EOFError, Warning) as e:
        raise InvalidArgument(field, f"cannot be decoded as {image_format}: {e}") from None
    return image


def _without(data: bytes, spans: tuple[tuple[int, int], ...]) -> bytes:
    """`data` with the byte ranges `spans` (in order, apart) cut out."""
    pieces, start = [], 0
    for begin, end in spans:
        pieces.append(data[start:begin])
        start = end
    pieces.append(data[start:])
    return b"".join(pieces)


def _open_header(data: bytes, image_format: str, max_pixels: int) -> Image.Image:
    """The file opened (its header read, no pixel decoded) under PIL's own bound set to ours: PIL checks
    it at open, and for WebP before libwebp reserves its canvas buffers (a 138-byte WebP claiming
    16,384 x 16,384 reserved 2 GB of address space with the bound lifted). PIL warns past the bound
    (an error here) and refuses past twice it."""
    with _BOUND:
        _filter_pil_warnings()
        bound, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, max_pixels
        try:
            return Image.open(io.BytesIO(data), formats=[image_format])
        finally:
            Image.MAX_IMAGE_PIXELS = bound


def _filter_pil_warnings() -> None:
    """PIL's UserWarnings ignored and its bomb warning an error, for the whole process, from the first
    file opened on: set where missing, never taken away.

    NOTE: why filters of the process, and why set at each open. PIL warns once for each broken metadata
    entry it skips, each in words of its own, so the warnings module's once-per-text rule lets every
    call warn again: a 60 KB JPEG's EXIF wrote 989 KB (9,998 lines, 4,999 warnings) to the log on each
    call, an 800 KB WebP's 11 MB. None of them is a reason to refuse. A catch_warnings around each
    decode swapped the one global list of filters for its span, unsafe across threads: another thread's
    warnings were dropped meanwhile. Set once at import, they were gone whenever the import ran inside
    someone's catch_warnings (pytest's collection is one), so each open checks they lead the list, a
    slice compared, and sets them again only if not (setting them clears every module's record of the
    warnings it showed once). Past our bound PIL's bomb warning is how it refuses (`_open_header`)."""
    if warnings.filters[: len(_PIL_FILTERS)] != _PIL_FILTERS:
        warnings.filterwarnings("ignore", category=UserWarning, module=r"PIL\.")
        warnings.filterwarnings("error", category=Image.DecompressionBombWarning)


def _check_palette_transparency(image: Image.Image, field: str) -> None:
    """A palette's tRNS gives at most one alpha an entry, 256 in all: PIL keeps a longer one and fails
    converting the picture to RGBA (ValueError "palette index out of range", out of the model's
    preprocessing, where nothing named the field). libpng drops such a chunk as invalid; here it is
    refused, naming its length."""
    key = image.info.get("transparency")
    if image.mode == "P" and isinstance(key, bytes) and len(key) > MAX_PALETTE_ENTRIES:
        raise InvalidArgument(
            field, f"a PNG's tRNS of {len(key)} palette alphas; a palette has at most {MAX_PALETTE_ENTRIES}"
        )


def _match_transparent_colour(image: Image.Image, bit_depth: int, grey_key: int | None = None) -> None:
    """A PNG's transparent colour (its tRNS chunk) put on the scale of the pixels PIL decoded. PIL keeps
    the file's sample values but widens a 2- or 4-bit grey picture's samples to 8 bits (x 85, x 17) and
    narrows a 16-bit RGB one's to their high bytes, then compares the key unscaled: a 4-bit grey key of
    3 (8-bit 51) matched no pixel, so the transparent grey showed opaque, and a 16-bit RGB key's low
    bytes matched whichever colour had them as high bytes, turning an unrelated colour white. 16-bit
    samples are gone once decoded, so a 16-bit key matches the colours that share its high bytes (each
    sample within 1/256 of it). The spec reads a key's low bit_depth bits alone, as libpng does: a 1-bit
    key of 2 is black there, where PIL, seeing it nonzero, made it white (`grey_key`, the file's own)."""
    key = image.info.get("transparency")
    if image.mode == "1" and isinstance(key, int) and bit_depth == 1 and grey_key is not None:
        image.info["transparency"] = (grey_key & 1) * 255
    elif image.mode == "L" and isinstance(key, int) and bit_depth in (2, 4, 8):
        most = (1 << bit_depth) - 1
        image.info["transparency"] = (key & most) * (255 // most)
    elif image.mode == "RGB" and isinstance(key, tuple) and bit_depth == 16:
        image.info["transparency"] = tuple(sample >> 8 for sample in key)


def _orientation(image: Image.Image, late_exif: bytes | None) -> int:
    """The EXIF (or XMP) orientation its header gives, else `late_exif`'s (a PNG's eXIf chunk after its
    pixels), 1 to 8; 1 where neither gives one. Read with the base class's getexif: PNG's own decodes
    the whole file first when no eXIf chunk came before the pixels, to read one after them, as
    transformers' load_image and vLLM do when they apply it (libpng's own pngtest.png has one there);
    `png_chunks` found it, and it is read with no decode. Metadata too broken to read is no
    orientation, as a browser shows such a file: the pixels decode as they did."""
    try:
        orientation = Image.Image.getexif(image).get(ExifTags.Base.Orientation)
        if orientation is None and late_exif is not None:
            exif = Image.Exif()
            exif.load(late_exif)
            orientation = exif.get(ExifTags.Base.Orientation)
        return orientation if orientation in _UPRIGHT else 1
    except Exception:
        return 1


@dataclass(frozen=True)
class JpegSegments:
    """What of a JPEG is read a piece at a time before its pixels (`jpeg_segments`)."""

    num_scans: int  # its SOS markers: libjpeg decodes the whole picture once a scan
    num_segments: int  # its marker segments (tables, metadata, comments, scans)
    num_resource_blocks: int  # "8BIM" resource blocks in its header's Photoshop APP13s, PIL's one each
    num_stray_bytes: int  # bytes between its header's segments: restart markers, fill, stuffed 0xFF, junk

    @property
    def num_reads(self) -> int:
        """What PIL steps through in Python when it opens the file (the segments after the first scan
        are libjpeg's, in C, but counted as well)."""
        return self.num_segments + self.num_resource_blocks + self.num_stray_bytes


def jpeg_segments(data: bytes) -> JpegSegments:
    """A JPEG's scans and segments, found by walking them (each names its length) and skipping
    entropy-coded data, where 0xFF is always followed by a stuffed 0x00 or a restart marker.

    NOTE: its header, up to the first scan, is what PIL reads in Python when it opens the file, a
    segment at a time, and whatever lies between segments a byte (or a 2-byte marker) at a time: 19
    MiB of restart markers there took 5.8 s of the image thread, and 320 APP13 segments of empty
    Photoshop resource blocks (each block read on its own) 1.3 s. So in the header those bytes and
    blocks count as well, and the search for the next segment looks no further than the bound leaves
    (over 19 MiB of 0xFF the search itself takes 0.24 s). The walk stops once a count passes its
    bound (MAX_JPEG_SCANS, MAX_CHUNKS for `num_reads`)."""
    scans = segments = blocks = stray = 0
    i = 2
    while i < len(data) and scans <= MAX_JPEG_SCANS and segments + blocks + stray <= MAX_CHUNKS:
        left = MAX_CHUNKS - (segments + blocks + stray)
        end = len(data) if scans else min(len(data), i + left + 3)  # stray bytes up to left + 1 found
        found = _JPEG_MARKER.search(data, i, end)
        if found is None:
            stray += 0 if scans else end - i  # past the bound, or PIL steps to the end of the file
            break
        if not scans:
            stray += found.start() - i
        i = found.start()  # the 0xFF just before the marker
        marker = data[i + 1]
        if marker == 0xD9 or i + 4 > len(data):  # end of image, or a cut file
            break
        segments += 1
        length = int.from_bytes(data[i + 2 : i + 4], "big")
        if marker == 0xDA:
            scans += 1
        elif marker == 0xED and not scans and data.startswith(b"Photoshop 3.0\x00", i + 4):
            blocks += data.count(b"8BIM", i + 4, i + 2 + length)  # each block opens with it: never fewer
        i += 2 + length
    return JpegSegments(scans, segments, blocks, stray)


@dataclass(frozen=True)
class PngChunks:
    """What of a PNG is read a chunk at a time, and what its chunks say before it is opened
    (`png_chunks`)."""

    num_chunks: int  # its chunks up to IEND
    num_profiles: int  # its iCCP chunks, each a colour profile PIL inflates
    exif: bytes | None  # its last eXIf chunk's payload (PIL keeps the last), None without one
    size: tuple[int, int] | None  # (width, height) its IHDR declares; None without one first
    bit_depth: int | None  # bits a sample (1, 2, 4, 8 or 16) its IHDR declares; None without one first
    num_headers: int  # its IHDR chunks (the spec: exactly one, first)
    # Where its compressed metadata chunks lie (zTXt, iTXt, iCCP), to be cut out before PIL reads the
    # file: nothing here reads text or applies a colour profile (nor do transformers' processors), and
    # PIL refuses the whole picture when one inflates past its MAX_TEXT_CHUNK (1 MB), even one after
    # the pixels; cut, none is inflated at all.
    metadata: tuple[tuple[int, int], ...] = ()
    # Its last 2-byte tRNS payload, a grey picture's transparent sample as the file spells it (PIL keeps
    # the last too); None without one. PIL reads a 1-bit key as 0 or 255 and loses the bits libpng reads.
    grey_key: int | None = None


def png_chunks(data: bytes) -> PngChunks:
    """A PNG's chunks up to IEND, found by walking them (each names its length); the walk stops once
    the count passes MAX_CHUNKS."""
    chunks = profiles = headers = 0
    exif: tuple[int, int] | None = None  # where the last eXIf's payload starts and ends
    metadata: list[tuple[int, int]] = []
    size = bit_depth = grey_key = None
    if data[12:16] == b"IHDR" and len(data) >= 24:
        size = (int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big"))
        bit_depth = data[24] if len(data) > 24 else None
    i = 8
    while chunks <= MAX_CHUNKS and i + 8 <= len(data):
        chunks += 1
        kind = data[i + 4 : i + 8]
        if kind == b"IEND":
            break
        length = int.from_bytes(data[i : i + 4], "big")
        profiles += kind == b"iCCP"
        headers += kind == b"IHDR"
        if kind == b"eXIf":
            exif = (i + 8, i + 8 + length)
        if kind == b"tRNS" and length == 2 and i + 10 <= len(data):
            grey_key = int.from_bytes(data[i + 8 : i + 10], "big")
        if kind in (b"zTXt", b"iTXt", b"iCCP") and i + 12 + length <= len(data):
            metadata.append((i, i + 12 + length))
        i += 12 + length
    return PngChunks(
        chunks,
        profiles,
        data[exif[0] : exif[1]] if exif is not None else None,
        size,
        bit_depth,
        headers,
        tuple(metadata),
        grey_key,
    )


def gif_blocks(data: bytes) -> int:
    """What PIL reads in Python before a GIF's first image, one read at a time (`gif_walk`): it counts
    what PIL would read, not what a well-formed GIF holds, and stops once the count passes MAX_CHUNKS."""
    return walk_to_first_image(data, MAX_CHUNKS)[0]
