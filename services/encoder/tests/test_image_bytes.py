"""Untrusted image bytes: each refusal names `image.data` and its limit, and comes before decoding."""

from __future__ import annotations

import base64
import contextlib
import gc
import io
import struct
import threading
import time
import warnings
import zlib
from collections.abc import Iterator

import pytest
from PIL import ExifTags, Image, ImageFile, ImageOps

from tandem.client import error_reasons as reasons
from tandem.client.errors import ErrorInfo, InvalidArgument
from tandem.encoder.vision.image_bytes import (
    MAX_CHUNKS,
    decode_image,
    gif_blocks,
    jpeg_segments,
    png_chunks,
    sniff_format,
)

MAX_BYTES = 1 << 20
MAX_PIXELS = 1 << 20


@contextlib.contextmanager
def _cpu_time_under(bound_s: float) -> Iterator[None]:
    """The block's CPU time on this thread stays under `bound_s`: a bound on the work a hostile input
    costs, between the fixed walk's and the unbounded one's (each test says what that took). CPU time,
    not wall time: the suite's other worker and a loaded host stretch the wall clock (0.215 s against a
    0.2 s bound, and 0.053 s against 0.05 s, in a clean-clone run on two workers), not this. The
    collector is run before and held off inside: a full collection of what earlier tests left (the
    processors test_rgb loads) took 0.1 s of this thread inside a 0.01 s decode, no cost of the input."""
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        start = time.thread_time()
        yield
        spent = time.thread_time() - start
    finally:
        if was_enabled:
            gc.enable()
    assert spent < bound_s, f"{spent:.3f} s of CPU; the bound is {bound_s} s"


def _encoded(image_format: str, size: tuple[int, int] = (20, 10), mode: str = "RGB") -> bytes:
    out = io.BytesIO()
    Image.new(mode, size, "red" if mode != "P" else 1).save(out, image_format)
    return out.getvalue()


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _png_claiming(width: int, height: int) -> bytes:
    """A valid PNG header for width x height with one tiny compressed row: a decompression bomb's shape."""
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _chunk(b"IHDR", header)
        + _chunk(b"IDAT", zlib.compress(b"\0" * 64))
        + _chunk(b"IEND", b"")
    )


@pytest.mark.parametrize(
    ("image_format", "name"), [("PNG", "PNG"), ("JPEG", "JPEG"), ("WEBP", "WEBP"), ("GIF", "GIF")]
)
def test_png_jpeg_webp_and_gif_decode_and_are_told_by_their_signature(image_format: str, name: str) -> None:
    data = _encoded(image_format)
    assert sniff_format(data) == name
    assert decode_image(data, MAX_BYTES, MAX_PIXELS).size == (20, 10)


@pytest.mark.parametrize("image_format", ["BMP", "TIFF", "ICO"])
def test_other_formats_are_refused_from_their_first_bytes(image_format: str) -> None:
    with pytest.raises(InvalidArgument, match="not a PNG, JPEG, WebP or GIF") as error:
        decode_image(_encoded(image_format), MAX_BYTES, MAX_PIXELS)
    assert error.value.field == "image.data"


URL_HINT = "is a data: URL, not a picture's bytes; send the PNG, JPEG, WebP or GIF bytes it encodes"


@pytest.mark.parametrize(
    "prefix", [b"data:", b"DATA:", b" data:", b"\ndata:", b"\xef\xbb\xbfdata:", b'"data:']
)
def test_a_data_url_is_refused_as_one_saying_to_send_the_bytes_it_encodes(prefix: bytes) -> None:
    # The OpenAI form of an image (the gateway's image_url) sent as Image.data: "not a PNG, JPEG, WebP
    # or GIF image" left the caller to guess that the URL's bytes, not the URL, were wanted; so did
    # leading whitespace, a byte-order mark or the quote of a JSON string pasted in.
    with pytest.raises(InvalidArgument) as error:
        decode_image(prefix + b"image/png;base64," + base64.b64encode(_encoded("PNG")), MAX_BYTES, MAX_PIXELS)
    assert (error.value.field, error.value.description) == ("image.data", URL_HINT)


@pytest.mark.parametrize(
    ("image_format", "name"), [("PNG", "PNG"), ("JPEG", "JPEG"), ("WEBP", "WebP"), ("GIF", "GIF")]
)
def test_plain_base64_of_a_picture_is_named_as_base64_saying_to_send_the_bytes_it_decodes_to(
    image_format: str, name: str
) -> None:
    with pytest.raises(InvalidArgument) as error:
        decode_image(base64.b64encode(_encoded(image_format)), MAX_BYTES, MAX_PIXELS)
    assert (error.value.field, error.value.description) == (
        "image.data",
        f"looks like base64 of a {name} image, not its bytes; send the bytes it decodes to",
    )


@pytest.mark.parametrize(
    ("data", "description"),
    [
        (  # the alphabet of a URL's query string: "_9j_" where plain base64 has "/9j/"
            base64.urlsafe_b64encode(_encoded("JPEG")),
            "looks like base64 of a JPEG image, not its bytes; send the bytes it decodes to",
        ),
        (
            b"https://example.com/cat.png",
            "is a URL, not a picture's bytes; send the picture's bytes (the encoder fetches no URL)",
        ),
        (
            b"HTTP://example.com/cat.png",
            "is a URL, not a picture's bytes; send the picture's bytes (the encoder fetches no URL)",
        ),
        (
            b'{"type": "image_url", "image_url": {"url": "data:image/png;base64,'
            + base64.b64encode(_encoded("PNG"))
            + b'"}}',
            "is JSON (an OpenAI image_url part?), not a picture's bytes; send the picture's bytes",
        ),
        (
            b' {"url": "data:image/png;base64,' + base64.b64encode(_encoded("PNG")) + b'"}',
            "is JSON (an OpenAI image_url part?), not a picture's bytes; send the picture's bytes",
        ),
    ],
)
def test_a_url_safe_base64_an_http_url_or_a_json_image_part_is_named_as_what_it_is(
    data: bytes, description: str
) -> None:
    # Each read "is not a PNG, JPEG, WebP or GIF image", leaving the caller to guess: a direct gRPC caller
    # passing the picture's address, or the OpenAI part pasted whole.
    with pytest.raises(InvalidArgument) as error:
        decode_image(data, MAX_BYTES, MAX_PIXELS)
    assert (error.value.field, error.value.description) == ("image.data", description)


def test_other_bytes_that_are_no_picture_keep_the_plain_message() -> None:
    for data in [b"{}", b"hello", b"http", b'{"a": 1}']:
        with pytest.raises(InvalidArgument, match="is not a PNG, JPEG, WebP or GIF image"):
            decode_image(data, MAX_BYTES, MAX_PIXELS)


def test_a_data_url_over_the_byte_limit_is_named_as_one_beside_the_limit() -> None:
    # Its bytes are 3/4 of the URL: they may fit where the URL does not.
    url = b"data:image/png;base64," + base64.b64encode(_encoded("PNG"))
    with pytest.raises(InvalidArgument) as error:
        decode_image(url, 50, MAX_PIXELS)
    assert error.value.description == f"{len(url)} bytes exceed max_image_bytes 50, and it {URL_HINT}"


def test_a_file_over_the_byte_limit_is_refused_by_its_size() -> None:
    data = _encoded("PNG")
    with pytest.raises(InvalidArgument, match=f"{len(data)} bytes exceed max_image_bytes 50") as error:
        decode_image(data, 50, MAX_PIXELS)
    # The gateway reads this refusal by its reason, not its wording.
    numbers = {reasons.IMAGE_BYTES: str(len(data)), reasons.MAX_IMAGE_BYTES: "50"}
    assert error.value.info == ErrorInfo(reasons.IMAGE_TOO_LARGE, reasons.ENCODER, numbers)


def test_a_header_claiming_too_many_pixels_is_refused_before_decoding() -> None:
    bomb = _png_claiming(100_000, 100_000)
    assert len(bomb) < 200
    with pytest.raises(InvalidArgument, match="claims 10000000000 pixels, over max_image_pixels 9999999999"):
        decode_image(bomb, MAX_BYTES, 10_000_000_000 - 1)  # above PIL's default bound: ours decides
    with pytest.raises(InvalidArgument, match="claims 9000000 pixels, over max_image_pixels 1048576"):
        decode_image(_png_claiming(3000, 3000), MAX_BYTES, MAX_PIXELS)
    with pytest.raises(InvalidArgument, match="claims 1500000 pixels, over max_image_pixels 1048576"):
        decode_image(_png_claiming(1500, 1000), MAX_BYTES, MAX_PIXELS)  # between ours and twice ours


def test_the_pixel_bound_is_ours_wherever_it_sits_against_pils_default() -> None:
    big = 20_000 * 10_000  # above PIL's default warning bound (89 Mpx)
    assert decode_image(_encoded("PNG"), MAX_BYTES, big).size == (20, 10)
    assert Image.MAX_IMAGE_PIXELS not in (big, MAX_PIXELS)  # restored after each open


def test_a_webp_claiming_a_huge_canvas_is_refused_before_libwebp_reserves_it() -> None:
    data = bytearray(_encoded("WEBP", (16, 16)))
    assert data[12:16] == b"VP8 "  # lossy: width and height at bytes 26..29, 14 bits each
    data[26:30] = (16383).to_bytes(2, "little") + (16383).to_bytes(2, "little")
    with pytest.raises(InvalidArgument, match="over max_image_pixels|cannot be decoded"):
        decode_image(bytes(data), MAX_BYTES, MAX_PIXELS)


def _progressive_jpeg_with_scans(extra_scans: int) -> bytes:
    """A valid progressive JPEG followed, before its end, by copies of its last scan."""
    out = io.BytesIO()
    Image.effect_noise((64, 64), 40).convert("L").save(out, "JPEG", progressive=True)
    data = out.getvalue()
    last_sos = data.rindex(b"\xff\xda")
    scan = data[last_sos:-2]
    return data[:-2] + scan * extra_scans + b"\xff\xd9"


def test_a_jpeg_of_many_scans_is_refused_before_decoding() -> None:
    from tandem.encoder.vision.image_bytes import MAX_JPEG_SCANS, jpeg_segments

    ordinary = _progressive_jpeg_with_scans(0)
    assert 2 <= jpeg_segments(ordinary).num_scans <= 12  # libjpeg's progression
    assert decode_image(ordinary, MAX_BYTES, MAX_PIXELS).size == (64, 64)
    assert jpeg_segments(_encoded("JPEG")).num_scans == 1  # baseline
    many = _progressive_jpeg_with_scans(200)
    assert jpeg_segments(many).num_scans == MAX_JPEG_SCANS + 1  # the walk stops past the bound
    with pytest.raises(
        InvalidArgument, match=f"over {MAX_JPEG_SCANS} scans; at most {MAX_JPEG_SCANS} are decoded"
    ):
        decode_image(many, MAX_BYTES, MAX_PIXELS)


def _jpeg_with(segments: bytes, after_first_scan: bytes = b"") -> bytes:
    """An 8 x 8 JPEG with `segments` after its SOI, and `after_first_scan` after its scan's header."""
    data = _encoded("JPEG", (8, 8))
    scan = data.index(b"\xff\xda")
    scan_end = scan + 2 + int.from_bytes(data[scan + 2 : scan + 4], "big")
    return data[:2] + segments + data[2:scan_end] + after_first_scan + data[scan_end:]


def test_a_file_of_more_chunks_or_segments_than_any_picture_has_is_refused_before_pil_reads_them() -> None:
    # PIL reads each in Python before any size rule: an 18 MiB PNG of 1.6 million empty ancillary
    # chunks took 6.2 s and +185 MB, a 19 MiB JPEG of 5 million empty APP5 segments 9.6 s and +658 MB.
    png = _png_claiming(8, 8)
    many_chunks = png[:33] + _chunk(b"abCd", b"") * (MAX_CHUNKS + 1) + png[33:]
    many_segments = _jpeg_with(b"\xff\xe5\x00\x02" * (MAX_CHUNKS + 1))
    for data, refusal in (
        (many_chunks, f"a PNG of over {MAX_CHUNKS} chunks; at most {MAX_CHUNKS} are read"),
        (many_segments, f"a JPEG of over {MAX_CHUNKS} segments, .*; at most {MAX_CHUNKS} are read"),
    ):
        with pytest.raises(InvalidArgument, match=refusal) as error:
            decode_image(data, len(data), MAX_PIXELS)
        assert error.value.field == "image.data"
    fewer = png[:33] + _chunk(b"abCd", b"") * 1000 + png[33:]
    assert (png_chunks(fewer).num_chunks, png_chunks(fewer).num_profiles) == (1003, 0)
    assert jpeg_segments(_jpeg_with(b"\xff\xe5\x00\x02" * 1000)).num_segments > 1000


def _png_of(*chunks: bytes, side: int = 6, bit_depth: int = 8, colour_type: int = 2) -> bytes:
    """A side x side PNG of one colour, 8-bit samples, with `chunks` between its IHDR and its pixels."""
    header = _chunk(b"IHDR", struct.pack(">IIBBBBB", side, side, bit_depth, colour_type, 0, 0, 0))
    row = b"\0" + (b"\x12\x56\x9a" if colour_type == 2 else b"\x01") * side
    pixels = _chunk(b"IDAT", zlib.compress(row * side))
    return b"\x89PNG\r\n\x1a\n" + header + b"".join(chunks) + pixels + _chunk(b"IEND", b"")


def test_a_png_must_begin_with_its_one_ihdr() -> None:
    # PIL reads a later IHDR and decodes by the last, while a transparent colour is scaled by the
    # first's bit depth: a 16-bit header, then an 8-bit one and a tRNS of (0x1234, 0x5678, 0x9abc)
    # made all 36 pixels (0x12, 0x56, 0x9a) white. libpng refuses both shapes.
    first = _png_of()
    sixteen_bit = _chunk(b"IHDR", struct.pack(">IIBBBBB", 6, 6, 16, 2, 0, 0, 0))
    key = _chunk(b"tRNS", struct.pack(">3H", 0x1234, 0x5678, 0x9ABC))
    two = first[:8] + sixteen_bit + _png_of(key)[8:]
    text_first = first[:8] + _chunk(b"tEXt", b"a\0b") + first[8:]
    for data, found in ((two, "2"), (text_first, "none first")):
        with pytest.raises(InvalidArgument, match=f"must begin with its one IHDR chunk .*; {found}") as error:
            decode_image(data, len(data), MAX_PIXELS)
        assert error.value.field == "image.data"
    assert decode_image(_png_of(key), MAX_BYTES, MAX_PIXELS).size == (6, 6)


def test_a_palette_png_of_more_than_256_alphas_is_refused_naming_them() -> None:
    # PIL kept all 300 and failed converting to RGBA ("palette index out of range", a ValueError out of
    # preprocessing, no field named); a tRNS up to 256 alphas, even past the palette's 4 colours, decodes.
    palette = _chunk(b"PLTE", bytes(range(12)))
    for alphas, refused in ((300, True), (257, True), (256, False), (5, False)):
        data = _png_of(palette, _chunk(b"tRNS", bytes(alphas)), colour_type=3)
        if refused:
            refusal = f"tRNS of {alphas} palette alphas; .* at most 256"
            with pytest.raises(InvalidArgument, match=refusal) as e:
                decode_image(data, MAX_BYTES, MAX_PIXELS)
            assert e.value.field == "image.data"
        else:
            assert decode_image(data, MAX_BYTES, MAX_PIXELS).convert("RGBA").size == (6, 6)


def test_restart_markers_in_a_scan_are_skipped_at_c_speed() -> None:
    # The walk over a scan's entropy-coded data stepped through each restart marker in Python: 1.75 s
    # for 9.5 MiB of them, on the image thread.
    data = _jpeg_with(b"", after_first_scan=b"\xff\xd0" * 2_000_000)
    with _cpu_time_under(0.4):
        assert jpeg_segments(data).num_scans == 1


def test_a_run_of_fill_bytes_with_no_marker_after_it_is_walked_once() -> None:
    # The marker's pattern held the run (\xff+): where no marker followed, the search began again at
    # each of its bytes, 22 s for 64 KiB of 0xFF closing a cut file (20 MiB: days).
    cut = _jpeg_with(b"")[:-2] + b"\xff" * 65_536
    with _cpu_time_under(0.4):
        assert jpeg_segments(cut).num_scans == 1


@pytest.mark.parametrize(
    "filler",
    [b"\xff\xd0", b"\xff\x00", b"\x00", b"\xff"],
    ids=["restart markers", "stuffed 0xFF", "junk", "fill bytes"],
)
def test_bytes_between_a_jpegs_header_segments_are_counted_as_pil_reads_them_one_at_a_time(
    filler: bytes,
) -> None:
    # PIL steps through whatever lies between the segments before the first scan in Python, a byte or a
    # marker at a time, and the walk skipped them uncounted: 19 MiB of restart markers took 5.8 s of
    # the image thread. An empty comment first: the signature is SOI and a marker.
    comment = b"\xff\xfe\x00\x02"
    assert jpeg_segments(_jpeg_with(comment + filler * 50)).num_stray_bytes == len(filler) * 50
    assert decode_image(_jpeg_with(comment + filler * 50), MAX_BYTES, MAX_PIXELS).size == (8, 8)
    data = _jpeg_with(comment + filler * (4 * 2**20 // len(filler)))
    with _cpu_time_under(0.2):  # the search went no further than the bound
        with pytest.raises(InvalidArgument, match=f"stray header bytes .*; at most {MAX_CHUNKS} are read"):
            decode_image(data, len(data), MAX_PIXELS)


def _photoshop_app13(num_blocks: int) -> bytes:
    """An APP13 segment of `num_blocks` empty Photoshop resource blocks (IPTC's code, no name)."""
    payload = b"Photoshop 3.0\x00" + (b"8BIM\x04\x04" + bytes(6)) * num_blocks
    return b"\xff\xed" + struct.pack(">H", len(payload) + 2) + payload


def test_the_photoshop_resource_blocks_of_a_jpegs_header_are_counted_as_pil_reads_each() -> None:
    # 320 such segments of empty blocks, 20 MiB, took 1.3 s of the image thread to open, within the
    # bound on segments.
    per_segment = (65_535 - 2 - 14) // 12
    data = _jpeg_with(_photoshop_app13(per_segment) * (MAX_CHUNKS // per_segment + 1))
    assert jpeg_segments(data).num_resource_blocks > MAX_CHUNKS
    with pytest.raises(InvalidArgument, match=f"Photoshop resource blocks .*; at most {MAX_CHUNKS} are read"):
        decode_image(data, len(data), MAX_PIXELS)


def _jpeg_saved(mode: str = "RGB", **options: object) -> bytes:
    out = io.BytesIO()
    Image.effect_noise((64, 48), 40).convert(mode).save(out, "JPEG", **options)
    return out.getvalue()


def _camera_exif() -> Image.Exif:
    exif = Image.Exif()
    exif[ExifTags.Base.Make], exif[ExifTags.Base.Model] = "Camera", "Model 1"
    exif[ExifTags.Base.Orientation] = 1
    exif.get_ifd(ExifTags.IFD.Exif)[ExifTags.Base.ExposureTime] = 0.01
    return exif


@pytest.mark.parametrize(
    "data",
    [
        _jpeg_saved(progressive=True),
        _jpeg_saved(restart_marker_rows=1),  # restart markers in the scan, after the header
        _jpeg_saved(icc_profile=bytes(range(256)) * 600),  # a profile over three APP2 segments
        _jpeg_saved("CMYK"),  # Adobe's APP14
        _jpeg_saved(exif=_camera_exif()),
        _jpeg_with(_photoshop_app13(3)),
    ],
    ids=["progressive", "restart markers", "ICC profile", "CMYK", "camera EXIF", "Photoshop APP13"],
)
def test_a_jpeg_as_encoders_write_it_has_no_stray_bytes_and_decodes_as_pil_decodes_it(data: bytes) -> None:
    walk = jpeg_segments(data)
    assert walk.num_stray_bytes == 0 and walk.num_reads < 30, walk
    decoded = decode_image(data, MAX_BYTES, MAX_PIXELS)
    assert decoded.tobytes() == Image.open(io.BytesIO(data)).tobytes()


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\x89PNG\r\n\x1a\n",  # the signature alone
        b"\xff\xd8\xff\xe0garbage",
        b"RIFF\x00\x00\x00\x00WEBPVP8 ",
    ],
)
def test_empty_or_broken_files_are_invalid_argument(data: bytes) -> None:
    with pytest.raises(InvalidArgument) as error:
        decode_image(data, MAX_BYTES, MAX_PIXELS)
    assert error.value.field == "image.data"
    assert "object at 0x" not in str(error.value)  # the same words each time, no buffer's address


def test_a_side_over_jpegs_limit_is_refused_from_the_header() -> None:
    # 4 KB of PNG, within the pixel bound: PIL's resize would hold a 1.6 GB weight table and the GIL
    # for seconds (SmolVLM's longest-edge resize), stalling every call of the encoder.
    for width, height in ((33_554_432, 1), (1, 65_536)):
        with pytest.raises(InvalidArgument, match="a side over 65535 pixels"):
            decode_image(_png_claiming(width, height), MAX_BYTES, 2**26)


def test_a_truncated_png_is_invalid_argument_not_a_crash() -> None:
    data = _encoded("PNG", (64, 64))
    with pytest.raises(InvalidArgument, match="cannot be decoded as PNG"):
        decode_image(data[: len(data) // 2], MAX_BYTES, MAX_PIXELS)


@pytest.mark.parametrize("mode", ["L", "RGBA", "P", "LA"])
def test_any_colour_mode_decodes(mode: str) -> None:
    assert decode_image(_encoded("PNG", mode=mode), MAX_BYTES, MAX_PIXELS).mode == mode


def test_the_callers_size_rules_run_on_the_header_before_any_pixel_is_decoded(monkeypatch) -> None:
    # A 1 x 33,000,000 PNG is within a 32 Mi pixel bound; decoding it took 1 s and 640 MB before the
    # resize it implied was refused. The size rules now see the header's size first (such a side is
    # now refused before them: a thin picture within the side bound shows the order).
    decoded = []
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda image: decoded.append(image.size))
    seen = []

    def refuse(width: int, height: int) -> None:
        seen.append((width, height))
        raise InvalidArgument("image.data", f"{width} x {height}: too thin")

    with pytest.raises(InvalidArgument, match="60000 x 1: too thin"):
        decode_image(_png_claiming(60_000, 1), MAX_BYTES, 32 * 1024 * 1024, check_size=refuse)
    assert seen == [(60_000, 1)] and decoded == []
    decode_image(_encoded("PNG"), MAX_BYTES, MAX_PIXELS, check_size=lambda w, h: seen.append((w, h)))
    assert seen[-1] == (20, 10) and set(decoded) == {(20, 10)}  # a size it takes: then decoded


def _with_orientation(image_format: str, orientation: int) -> bytes:
    """A 30 x 20 picture of distinct pixels tagged with an EXIF orientation (1 to 8)."""
    pixels = Image.effect_noise((30, 20), 64).convert("RGB")
    exif = Image.Exif()
    exif[ExifTags.Base.Orientation] = orientation
    out = io.BytesIO()
    pixels.save(out, image_format, exif=exif, **({"lossless": True} if image_format == "WEBP" else {}))
    return out.getvalue()


@pytest.mark.parametrize("orientation", range(1, 9))
@pytest.mark.parametrize("image_format", ["JPEG", "PNG", "WEBP"])
def test_a_picture_is_taken_upright_as_its_exif_orientation_shows_it(
    image_format: str, orientation: int
) -> None:
    # A phone stores a portrait photo sideways and tags it "rotate 90": browsers, transformers'
    # load_image and vLLM show it upright (PIL's exif_transpose is the reference), and the size rules
    # see that shown size.
    data = _with_orientation(image_format, orientation)
    seen: list[tuple[int, int]] = []
    image = decode_image(data, MAX_BYTES, MAX_PIXELS, check_size=lambda w, h: seen.append((w, h)))
    upright = ImageOps.exif_transpose(Image.open(io.BytesIO(data)))
    assert image.size == upright.size == seen[0] == ((20, 30) if orientation >= 5 else (30, 20))
    assert image.tobytes() == upright.convert(image.mode).tobytes()


def _with_exif_after_pixels(data: bytes) -> bytes:
    """A PNG with its eXIf chunk moved from before its pixels to after them, before IEND."""
    start = data.index(b"eXIf") - 4
    end = start + 12 + int.from_bytes(data[start : start + 4], "big")
    rest = data[:start] + data[end:]
    iend = rest.index(b"IEND") - 4
    return rest[:iend] + data[start:end] + rest[iend:]


@pytest.mark.parametrize("orientation", [1, 3, 5, 6, 8])
def test_a_pngs_exif_orientation_after_its_pixels_is_applied_as_transformers_and_vllm_apply_it(
    orientation: int,
) -> None:
    # libpng's own pngtest.png has its eXIf there; PIL reads it only with the pixels, and transformers'
    # load_image and vLLM apply it with exif_transpose after they load the picture. The size rules see
    # the shown size all the same, and nothing is decoded before them.
    data = _with_exif_after_pixels(_with_orientation("PNG", orientation))
    assert data.index(b"eXIf") > data.index(b"IDAT")
    assert png_chunks(data).exif is not None
    seen: list[tuple[int, int]] = []
    image = decode_image(data, MAX_BYTES, MAX_PIXELS, check_size=lambda w, h: seen.append((w, h)))
    upright = ImageOps.exif_transpose(Image.open(io.BytesIO(data)))
    assert image.size == upright.size == seen[0] == ((20, 30) if orientation >= 5 else (30, 20))
    assert image.tobytes() == upright.convert(image.mode).tobytes()


def _jpeg_with_broken_exif(num_entries: int) -> bytes:
    """A JPEG with no JFIF segment (so PIL reads its EXIF for the resolution when it opens it), whose
    EXIF names `num_entries` tags each claiming more data than the segment holds."""
    out = io.BytesIO()
    Image.new("RGB", (8, 8)).save(out, "JPEG")
    jpeg = out.getvalue()
    assert jpeg[2:4] == b"\xff\xe0"  # JFIF's APP0, dropped
    jpeg = jpeg[:2] + jpeg[4 + int.from_bytes(jpeg[4:6], "big") :]
    entries = b"".join(struct.pack("<HHII", tag, 7, 60_000, 0) for tag in range(1, num_entries + 1))
    tiff = b"II*\x00" + struct.pack("<I", 8) + struct.pack("<H", num_entries) + entries + bytes(4)
    segment = b"Exif\x00\x00" + tiff
    return jpeg[:2] + b"\xff\xe1" + struct.pack(">H", len(segment) + 2) + segment + jpeg[2:]


def test_broken_metadata_neither_refuses_the_picture_nor_writes_to_the_log() -> None:
    # PIL warned once for every entry it skipped, in words of its own each time: 989 KB (9,998 lines,
    # 4,999 warnings) on the encoder's stderr for each call of a 60 KB JPEG.
    data = _jpeg_with_broken_exif(5000)
    assert len(data) < 64 * 1024
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        assert decode_image(data, MAX_BYTES, MAX_PIXELS).size == (8, 8)
    assert warned == []
    with pytest.raises(InvalidArgument, match="claims 1100000 pixels"):  # PIL's bomb warning still refuses
        decode_image(_png_claiming(1100, 1000), MAX_BYTES, MAX_PIXELS)


def test_a_png_of_more_than_one_colour_profile_is_refused_before_pil_inflates_them() -> None:
    # PIL inflated every iCCP chunk (up to 1 MB each) and kept the last: 19,000 chunks of a 1 KB
    # zlib stream each, 18 MiB in all, took 42 s of the image thread. The PNG spec allows one.
    profile = _chunk(b"iCCP", b"p\0\0" + zlib.compress(bytes(1_000_000), 9))
    png = _encoded("PNG", (8, 8))
    assert decode_image(png[:33] + profile + png[33:], MAX_BYTES, MAX_PIXELS).size == (8, 8)
    with _cpu_time_under(0.2):  # 200 inflated took 0.44 s
        with pytest.raises(InvalidArgument, match="a PNG of 200 iCCP chunks; the PNG spec allows one"):
            decode_image(png[:33] + profile * 200 + png[33:], MAX_BYTES, MAX_PIXELS)


def _gif(frames: list[str], size: tuple[int, int] = (4, 4)) -> bytes:
    """A GIF of one frame per colour (an animation when several), its frames written whole."""
    out = io.BytesIO()
    images = [Image.new("RGB", size, colour) for colour in frames]
    images[0].save(out, "GIF", save_all=len(images) > 1, append_images=images[1:], optimize=False)
    return out.getvalue()


def _gif_parts(data: bytes) -> tuple[bytes, bytes, bytes]:
    """(header and colour table, first frame from its descriptor, the rest) of a GIF of one frame."""
    start = 13 + (3 << ((data[10] & 7) + 1) if data[10] & 0x80 else 0)
    frame = data.index(b"\x2c", start)
    return data[:start], data[frame:-1], data[-1:]


def test_a_gif_gives_its_first_frame_as_an_animated_png_or_webp_does() -> None:
    # OpenAI takes a non-animated GIF; an animated one is its first frame here, as PIL and vLLM read it.
    still = decode_image(_gif(["red"]), MAX_BYTES, MAX_PIXELS)
    animated = decode_image(_gif(["red", "blue", "green"]), MAX_BYTES, MAX_PIXELS)
    assert still.size == animated.size == (4, 4)
    assert still.convert("RGB").getpixel((1, 1)) == animated.convert("RGB").getpixel((1, 1)) == (255, 0, 0)


def test_a_gif_of_many_frames_costs_its_first_frame_only() -> None:
    header, frame, trailer = _gif_parts(_gif(["red"]))
    many = header + frame * 200_001 + trailer  # 3.8 MB: PIL reads no frame after the first
    with _cpu_time_under(0.1):
        assert decode_image(many, len(many), MAX_PIXELS).size == (4, 4)


def test_a_gif_bomb_is_refused_from_its_header_before_any_frame_is_inflated() -> None:
    header, frame, trailer = _gif_parts(_gif(["red"]))
    screen = bytearray(header + frame + trailer)
    screen[6:10] = struct.pack("<HH", 65_535, 65_535)  # a huge logical screen in 40 bytes
    beyond = bytearray(header + frame + trailer)
    at = len(header)  # the first frame reaching far past its 4 x 4 screen
    beyond[at + 5 : at + 9] = struct.pack("<HH", 60_000, 60_000)
    out = io.BytesIO()
    Image.new("P", (2048, 1024), 0).save(out, "GIF")  # LZW: 2 Mpx of one colour in a few KB
    lzw = out.getvalue()
    # PIL reads an extension's sub-blocks in Python (1 million: 0.3 s), all before any size rule.
    sub_blocks = b"\x01x" * (MAX_CHUNKS + 1) + b"\x00"
    extensions = header + b"\x21\xfe" + sub_blocks + frame + trailer
    # A byte other than '!', ',' or ';' PIL skips, one read at a time (20 MB: 1.5 s); and after an
    # extension's first sub-block, even the empty one ending it, PIL reads on to the next empty one
    # (10 million sub-blocks past an empty graphic control extension: 1.3 s), as it does after an
    # application extension's NETSCAPE2.0 block and its loop count's read. Each was counted as 0 or 1.
    strays = header + b"\x01" * (MAX_CHUNKS + 1) + frame + trailer
    past_empty = header + b"\x21\xf9\x00" + sub_blocks + frame + trailer
    past_loop = header + b"\x21\xff\x0bNETSCAPE2.0\x00" + sub_blocks + frame + trailer
    too_many = f"a GIF of over {MAX_CHUNKS} blocks and sub-blocks before its first frame"
    for data, refusal in (
        (bytes(screen), "claims 4294836225 pixels, over max_image_pixels"),
        (bytes(beyond), "claims 3600000000 pixels, over max_image_pixels"),
        (lzw, "claims 2097152 pixels, over max_image_pixels 1048576"),
        (extensions, too_many),
        (strays, too_many),
        (past_empty, too_many),
        (past_loop, too_many),
    ):
        assert len(data) < 140_000
        with _cpu_time_under(0.1), pytest.raises(InvalidArgument, match=refusal) as error:
            decode_image(data, MAX_BYTES, MAX_PIXELS)
        assert error.value.field == "image.data"
    assert gif_blocks(_gif(["red", "blue"])) < 10
    assert gif_blocks(header + b"\x21\xfe\x01x\x00" * 1000 + frame) == 2000
    assert gif_blocks(header + b"\x21\xfe\x00" * 1000 + frame) == 1000  # an empty comment ends there


class _NeighbourWarning(Warning):
    """A warning of another thread than the decoding one: none of PIL's."""


def test_a_decode_leaves_the_warnings_of_other_threads_alone() -> None:
    # A catch_warnings around each decode swapped the process's one list of filters for "ignore" while
    # it ran: another thread's warnings were dropped meanwhile.
    data = _jpeg_with_broken_exif(5000)
    done = threading.Event()

    def decode_until_done() -> None:
        while not done.is_set():
            decode_image(data, MAX_BYTES, MAX_PIXELS)

    decoding = threading.Thread(target=decode_until_done)
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always", _NeighbourWarning)
        decoding.start()
        try:
            for i in range(50):
                warnings.warn(f"neighbour {i}", _NeighbourWarning, stacklevel=1)
                time.sleep(0.001)
        finally:
            done.set()
            decoding.join()
    assert [str(w.message) for w in warned if w.category is _NeighbourWarning] == [
        f"neighbour {i}" for i in range(50)
    ]


def test_a_png_of_no_pixels_is_told_as_one_not_as_no_png() -> None:
    for width, height in ((0, 10), (10, 0)):
        with pytest.raises(InvalidArgument, match=rf"has no pixels \({width} x {height}\)"):
            decode_image(_png_claiming(width, height), 1 << 20, 1 << 20)


@pytest.mark.parametrize(
    "metadata",
    [
        _chunk(b"zTXt", b"Comment\0\0" + zlib.compress(bytes(2_000_000), 9)),
        _chunk(b"iTXt", b"Comment\0\1\0\0\0" + zlib.compress(bytes(2_000_000), 9)),
        _chunk(b"iCCP", b"p\0\0" + zlib.compress(bytes(2_000_000), 9)),
    ],
)
def test_compressed_metadata_inflating_past_pils_bound_does_not_refuse_the_picture(metadata: bytes) -> None:
    # PIL refuses the whole file when one inflates past PngImagePlugin.MAX_TEXT_CHUNK (1 MB), even after
    # the pixels; the chunks are cut out unread, before and after the pixels alike.
    png = _encoded("PNG", (6, 4))
    iend = png.rindex(b"IEND") - 4
    first = png.index(b"IDAT") - 4
    for data in (png[:iend] + metadata + png[iend:], png[:first] + metadata + png[first:]):
        image = decode_image(data, 1 << 22, 1 << 20)
        assert image.size == (6, 4) and image.getpixel((0, 0)) == (255, 0, 0)
