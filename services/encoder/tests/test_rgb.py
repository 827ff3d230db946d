"""Every pixel mode a PNG, JPEG, WebP or GIF decodes to reaches the tower as the picture's own 8-bit
RGB: a ramp stays a ramp through decode and both processors (LLaVA's and SmolVLM's), 16-bit samples
are scaled by their high byte (never clipped to white), transparency is white, and a mode with no
faithful conversion is refused by name."""

from __future__ import annotations

import io
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
from PIL import Image

from tandem.client.errors import InvalidArgument
from tandem.encoder.vision.idefics3_preprocess import Idefics3Processing
from tandem.encoder.vision.image_bytes import decode_image
from tandem.encoder.vision.preprocess import ImageProcessing
from tandem.encoder.vision.rgb import rgb_for_processor, to_rgb

SIDE = 16
# [SIDE, SIDE] uint8: every 8-bit value once, row by row.
RAMP = np.arange(SIDE * SIDE, dtype=np.uint8).reshape(SIDE, SIDE)
# [SIDE, SIDE] uint16 whose high bytes are RAMP and whose low bytes vary apart from them, so that v >> 8,
# round(v / 257) and a clip to 255 all give different pixels.
RAMP_16 = (RAMP.astype(np.uint16) << 8) | (255 - RAMP).astype(np.uint16)
CLEAR_COLUMN = 3  # the column made transparent where a case has transparency
WHITE = 255


@dataclass(frozen=True)
class Case:
    """One way a picture arrives: its encoded bytes and the RGB it must become."""

    name: str
    encode: Callable[[], bytes]  # the file's bytes, made here (by PIL where it can write them)
    mode: str  # the pixel mode PIL decodes it to: the table is the list of modes we handle
    expected: np.ndarray  # [SIDE, SIDE, 3] uint8
    tolerance: int = 0  # the most a sample may differ from `expected` (a lossy format's error)


def _saved(image: Image.Image, image_format: str, **options: object) -> bytes:
    out = io.BytesIO()
    image.save(out, image_format, **options)
    return out.getvalue()


def _png(samples: np.ndarray, colour_type: int, bit_depth: int, transparent: tuple[int, ...] = ()) -> bytes:
    """A PNG of `samples` ([height, width, channels]) as written by the spec, for the layouts PIL cannot
    write (2- and 4-bit grey, 16-bit RGB, grey-alpha and RGBA), with `transparent` as its tRNS colour."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    height, width = samples.shape[:2]
    rows = samples.astype(">u2" if bit_depth == 16 else np.uint8).reshape(height, -1).view(np.uint8)
    if bit_depth < 8:  # each sample's low bit_depth bits, packed most significant first
        bits = np.unpackbits(rows[:, :, None], axis=2)[:, :, 8 - bit_depth :]
        rows = np.packbits(bits.reshape(height, -1), axis=1)
    raw = b"".join(b"\x00" + row.tobytes() for row in rows)  # filter 0 (none) before each row
    header = struct.pack(">IIBBBBB", width, height, bit_depth, colour_type, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + (chunk(b"tRNS", struct.pack(f">{len(transparent)}H", *transparent)) if transparent else b"")
        + chunk(b"IDAT", zlib.compress(raw))
        + chunk(b"IEND", b"")
    )


def _grey(values: np.ndarray) -> np.ndarray:
    """[h, w] -> [h, w, 3]."""
    return np.repeat(values[:, :, None], 3, axis=2)


def _cleared(rgb: np.ndarray) -> np.ndarray:
    """`rgb` with CLEAR_COLUMN white: a transparent pixel on white."""
    rgb = rgb.copy()
    rgb[:, CLEAR_COLUMN] = WHITE
    return rgb


def _alpha(opaque: int = 255) -> np.ndarray:
    """[SIDE, SIDE] alpha: opaque but for CLEAR_COLUMN."""
    alpha = np.full((SIDE, SIDE), opaque)
    alpha[:, CLEAR_COLUMN] = 0
    return alpha


# [SIDE, SIDE, 3] uint8: three channels that differ, so a swapped or dropped channel shows.
COLOUR = np.stack([RAMP, 255 - RAMP, RAMP // 2], axis=2)
COLOUR_16 = np.stack([RAMP_16, 65535 - RAMP_16, RAMP_16 // 2], axis=2)
KEY = 77  # the ramp value made the transparent colour


def _p_image(palette: np.ndarray) -> Image.Image:
    """RAMP's values as indices into `palette` ([256, 3] uint8)."""
    image = Image.fromarray(RAMP).convert("P")
    image.putpalette(palette.tobytes())
    return image


GREY_PALETTE = _grey(np.arange(256, dtype=np.uint8)[None])[0]  # [256, 3]: index v is grey v
COLOUR_PALETTE = COLOUR.reshape(-1, 3)  # [256, 3]: index v is COLOUR's pixel v


CASES = [
    Case("png-1-bit", lambda: _saved(Image.fromarray(RAMP >= 128), "PNG"), "1", _grey((RAMP >= 128) * 255)),
    # A 1-bit key is a sample, 0 or 1: its pixels black or white, the white ones white on white anyway.
    Case(
        "png-1-bit-transparent-black",
        lambda: _png((RAMP >= 128)[:, :, None], 0, 1, transparent=(0,)),
        "1",
        _grey(np.full((SIDE, SIDE), WHITE)),
    ),
    Case(
        "png-1-bit-transparent-white",
        lambda: _png((RAMP >= 128)[:, :, None], 0, 1, transparent=(1,)),
        "1",
        _grey((RAMP >= 128) * 255),
    ),
    # Only a key's low bit counts (the spec; libpng): 2 is black, which PIL, seeing it nonzero, read as white.
    Case(
        "png-1-bit-transparent-out-of-range",
        lambda: _png((RAMP >= 128)[:, :, None], 0, 1, transparent=(2,)),
        "1",
        _grey(np.full((SIDE, SIDE), WHITE)),
    ),
    Case("png-2-bit", lambda: _png(RAMP[:, :, None] >> 6, 0, 2), "L", _grey((RAMP >> 6) * 85)),
    Case("png-4-bit", lambda: _png(RAMP[:, :, None] >> 4, 0, 4), "L", _grey((RAMP >> 4) * 17)),
    # PIL widens these samples to 8 bits but not the key: the transparent grey showed opaque.
    Case(
        "png-2-bit-transparent-colour",
        lambda: _png(RAMP[:, :, None] >> 6, 0, 2, transparent=(1,)),
        "L",
        _grey(np.where(RAMP >> 6 == 1, WHITE, (RAMP >> 6) * 85)),
    ),
    Case(
        "png-4-bit-transparent-colour",
        lambda: _png(RAMP[:, :, None] >> 4, 0, 4, transparent=(KEY >> 4,)),
        "L",
        _grey(np.where(RAMP >> 4 == KEY >> 4, WHITE, (RAMP >> 4) * 17)),
    ),
    Case("png-L", lambda: _saved(Image.fromarray(RAMP), "PNG"), "L", _grey(RAMP)),
    Case(
        "png-L-transparent-colour",
        lambda: _saved(Image.fromarray(RAMP), "PNG", transparency=KEY),
        "L",
        _grey(np.where(RAMP == KEY, WHITE, RAMP)),
    ),
    Case(
        "png-LA",
        lambda: _saved(Image.fromarray(np.stack([RAMP, _alpha()], axis=2).astype(np.uint8)), "PNG"),
        "LA",
        _cleared(_grey(RAMP)),
    ),
    Case("png-P", lambda: _saved(_p_image(COLOUR_PALETTE), "PNG"), "P", COLOUR),
    Case(
        "png-P-transparent-index",
        lambda: _saved(_p_image(COLOUR_PALETTE), "PNG", transparency=KEY),
        "P",
        np.where((RAMP == KEY)[:, :, None], WHITE, COLOUR),
    ),
    Case("png-RGB", lambda: _saved(Image.fromarray(COLOUR), "PNG"), "RGB", COLOUR),
    Case(
        "png-RGB-transparent-colour",
        lambda: _saved(
            Image.fromarray(COLOUR), "PNG", transparency=tuple(int(c) for c in COLOUR[0, KEY % SIDE])
        ),
        "RGB",
        np.where((COLOUR == COLOUR[0, KEY % SIDE]).all(axis=2)[:, :, None], WHITE, COLOUR),
    ),
    Case(
        "png-RGBA",
        lambda: _saved(Image.fromarray(np.dstack([COLOUR, _alpha()]).astype(np.uint8)), "PNG"),
        "RGBA",
        _cleared(COLOUR),
    ),
    Case("png-16-bit-grey", lambda: _saved(Image.fromarray(RAMP_16), "PNG"), "I;16", _grey(RAMP)),
    Case(
        "png-16-bit-grey-transparent-colour",
        lambda: _saved(Image.fromarray(RAMP_16), "PNG", transparency=int(RAMP_16[0, KEY % SIDE] + 0)),
        "I;16",
        _grey(np.where(RAMP_16 == RAMP_16[0, KEY % SIDE], WHITE, RAMP)),
    ),
    Case("png-16-bit-RGB", lambda: _png(COLOUR_16, 2, 16), "RGB", COLOUR),
    # PIL compared the key's low bytes with the pixels' high bytes: COLOUR's pixel 178 (the key's
    # low bytes) turned white and the key's own stayed.
    Case(
        "png-16-bit-RGB-transparent-colour",
        lambda: _png(COLOUR_16, 2, 16, transparent=tuple(int(c) for c in COLOUR_16[KEY // SIDE, KEY % SIDE])),
        "RGB",
        np.where((RAMP == KEY)[:, :, None], WHITE, COLOUR),
    ),
    Case(
        "png-16-bit-grey-alpha",
        lambda: _png(np.stack([RAMP_16, _alpha(65535)], axis=2), 4, 16),
        "RGBA",
        _cleared(_grey(RAMP)),
    ),
    Case(
        "png-16-bit-RGBA",
        lambda: _png(np.dstack([COLOUR_16, _alpha(65535)]), 6, 16),
        "RGBA",
        _cleared(COLOUR),
    ),
    # JPEG is lossy: a smooth ramp at quality 100 comes back within a few levels.
    Case("jpeg-L", lambda: _saved(Image.fromarray(RAMP), "JPEG", quality=100), "L", _grey(RAMP), 3),
    Case(
        "jpeg-RGB",
        lambda: _saved(Image.fromarray(COLOUR), "JPEG", quality=100, subsampling=0),
        "RGB",
        COLOUR,
        3,
    ),
    Case(
        "jpeg-CMYK",
        lambda: _saved(Image.fromarray(RAMP).convert("CMYK"), "JPEG", quality=100),
        "CMYK",
        _grey(RAMP),
        3,
    ),
    Case("webp-RGB", lambda: _saved(Image.fromarray(COLOUR), "WEBP", lossless=True), "RGB", COLOUR),
    Case(
        "webp-RGBA",
        lambda: _saved(
            Image.fromarray(np.dstack([COLOUR, _alpha()]).astype(np.uint8)), "WEBP", lossless=True
        ),
        "RGBA",
        _cleared(COLOUR),
    ),
    Case("gif-P", lambda: _saved(_p_image(COLOUR_PALETTE), "GIF"), "P", COLOUR),
    Case(
        "gif-P-transparent-index",
        lambda: _saved(_p_image(COLOUR_PALETTE), "GIF", transparency=KEY),
        "P",
        np.where((RAMP == KEY)[:, :, None], WHITE, COLOUR),
    ),
    # PIL opens a GIF whose palette is all greys as "L".
    Case("gif-grey-palette", lambda: _saved(_p_image(GREY_PALETTE), "GIF"), "L", _grey(RAMP)),
    Case("gif-L", lambda: _saved(Image.fromarray(RAMP >= 128), "GIF"), "L", _grey((RAMP >= 128) * 255)),
]


def _processors() -> dict[str, Callable[[Image.Image], np.ndarray]]:
    """Each processor with every step but the conversion off, as [SIDE, SIDE, 3] samples."""
    off = {"do_resize": False, "do_rescale": False, "do_normalize": False}
    llava = ImageProcessing.from_hf(off, ValueError)
    smolvlm = Idefics3Processing.from_hf(
        {**off, "do_image_splitting": False, "max_image_size": {"longest_edge": SIDE}}, ValueError
    )
    return {
        "llava": lambda image: llava(image).permute(1, 2, 0).numpy(),
        "smolvlm": lambda image: smolvlm(image).pixels[0].permute(1, 2, 0).numpy(),
    }


@pytest.mark.parametrize("processor", ["llava", "smolvlm"])
@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_each_decoded_mode_reaches_the_tower_as_its_own_pixels(case: Case, processor: str) -> None:
    image = decode_image(case.encode(), 1 << 20, 1 << 20)
    assert image.mode == case.mode
    pixels = _processors()[processor](image)  # [SIDE, SIDE, 3] float32 of 0..255
    difference = np.abs(pixels - case.expected.astype(np.float32))
    assert difference.max() <= case.tolerance, f"{case.name}: off by {difference.max()}"


def test_16_bit_samples_are_scaled_by_their_high_byte_not_clipped() -> None:
    image = decode_image(_saved(Image.fromarray(RAMP_16), "PNG"), 1 << 20, 1 << 20)
    assert image.mode == "I;16"
    assert image.convert("RGB").getextrema() == ((WHITE, WHITE),) * 3  # PIL's clip: all of it white
    assert np.array_equal(np.asarray(to_rgb(image)), _grey(RAMP))


@pytest.mark.parametrize("mode", ["I;16", "I;16B", "I;16L", "I;16N", "I"])
def test_every_16_bit_layout_is_read_the_same(mode: str) -> None:
    # Built from bytes: PIL's convert between these modes clips to 255 as well.
    dtype = {"I;16B": ">u2", "I;16L": "<u2", "I;16N": "=u2", "I;16": "<u2", "I": "=i4"}[mode]
    image = Image.frombytes(mode, (SIDE, SIDE), RAMP_16.astype(dtype).tobytes())
    assert image.mode == mode
    assert np.array_equal(np.asarray(to_rgb(image)), _grey(RAMP))


@pytest.mark.parametrize(("mode", "expected"), [("La", _grey(RAMP)), ("RGBa", COLOUR), ("PA", _grey(RAMP))])
def test_the_other_alpha_modes_composite_onto_white(mode: str, expected: np.ndarray) -> None:
    image = Image.fromarray(np.dstack([expected if mode == "RGBa" else RAMP, _alpha()]).astype(np.uint8))
    if mode == "PA":
        grey = _p_image(GREY_PALETTE).convert("PA")
        grey.putalpha(Image.fromarray(_alpha().astype(np.uint8)))
        image = grey
    else:
        image = image.convert(mode)
    assert image.mode == mode
    assert np.array_equal(np.asarray(to_rgb(image)), _cleared(expected))


@pytest.mark.parametrize(
    ("image", "message"),
    [
        (
            Image.fromarray(np.array([[-1, 7]], dtype=np.int32)),
            r"mode 'I' .* from -1 to 7: .* within 0\.\.65535",
        ),
        (Image.fromarray(np.array([[0, 70_000]], dtype=np.int32)), r"from 0 to 70000"),
        (Image.fromarray(RAMP.astype(np.float32) / 255), r"mode 'F', floating-point samples"),
        (Image.fromarray(COLOUR).convert("HSV"), r"mode 'HSV', which the encoder does not convert"),
    ],
    ids=["I-negative", "I-over-16-bit", "F", "HSV"],
)
def test_a_mode_with_no_faithful_conversion_is_refused_by_name(image: Image.Image, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message) as refusal:
        to_rgb(image)
    assert refusal.value.field == "image.data"


@pytest.mark.parametrize("mode", ["I;16", "L", "RGBA"])
def test_a_processor_that_converts_none_refuses_a_picture_that_is_not_rgb(mode: str) -> None:
    image = Image.fromarray(RAMP_16) if mode == "I;16" else Image.fromarray(COLOUR).convert(mode)
    with pytest.raises(InvalidArgument, match=f"image mode '{mode}' is not RGB"):
        rgb_for_processor(image, convert_rgb=False)
    rgb = Image.fromarray(COLOUR)
    assert rgb_for_processor(rgb, convert_rgb=False) is rgb
