"""LLaVA's image half in every configuration its config.json can name, against transformers'
`get_image_features` on the same checkpoint (float32, random weights)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from services.encoder.tests.resizes import record_resizes
from services.encoder.tests.vision_checkpoints import IMAGE_TOKEN, make_image, make_llava
from tandem.encoder.embedder import MAX_IMAGE_PLACEHOLDER_BYTES, EmbedderLoadError
from tandem.encoder.vision.embedder import VisionLanguageEmbedder

VARIANTS = {
    "clip, default (drops the class row)": dict(tower="clip", strategy="default"),
    "clip, full (keeps it)": dict(tower="clip", strategy="full"),
    "siglip, full": dict(tower="siglip", strategy="full"),
    "siglip, default (drops row 0 all the same)": dict(tower="siglip", strategy="default"),
    "clip, two layers side by side": dict(tower="clip", strategy="default", feature_layer=[-3, -1]),
    "clip, the last layer": dict(tower="clip", strategy="default", feature_layer=-1),
    "siglip, projector without bias": dict(tower="siglip", strategy="full", projector_bias=False),
}


@pytest.mark.parametrize("name", VARIANTS)
def test_image_rows_are_transformers_image_features(name: str, tmp_path: Path) -> None:
    from transformers import LlavaForConditionalGeneration

    model_dir = make_llava(tmp_path / "llava", **VARIANTS[name])  # type: ignore[arg-type]
    picture = Image.open(make_image(tmp_path / "picture.png", (47, 29)))
    ours = VisionLanguageEmbedder.load(model_dir, torch.float32)
    prepared = ours.prepare_image(picture)
    rows = ours.embed_images([prepared])[0]
    model = LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).train(False)
    with torch.no_grad():
        features = model.get_image_features(pixel_values=prepared.pixels)
    features = getattr(features, "pooler_output", features)
    expected = (features[0] if isinstance(features, list | tuple) else features).reshape(-1, rows.shape[-1])
    assert rows.shape == expected.shape, name
    torch.testing.assert_close(rows, expected, atol=1e-5, rtol=0)
    assert len(prepared.token_ids) == rows.shape[0]


def test_the_span_size_is_known_from_a_header_and_an_extreme_aspect_ratio_refused_there(
    tmp_path: Path,
) -> None:
    from tandem.client.errors import InvalidArgument

    embedder = VisionLanguageEmbedder.load(make_llava(tmp_path / "llava"), torch.float32)
    picture = Image.new("RGB", (47, 29))
    assert embedder.image_span_size(47, 29) == len(embedder.prepare_image(picture).token_ids)
    with pytest.raises(InvalidArgument, match="aspect ratio is too extreme"):
        embedder.image_span_size(33_000_000, 1)


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory) -> VisionLanguageEmbedder:
    return VisionLanguageEmbedder.load(make_llava(tmp_path_factory.mktemp("llava")), torch.float32)


@pytest.mark.parametrize("size", [(47, 29), (36, 36), (1, 800), (800, 1)])
def test_the_pixels_the_preparation_makes_are_known_from_a_header(
    llava: VisionLanguageEmbedder, size: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    # What the batcher weighs a call by: its resize (a 1 x 800 picture is resized to 36 x 28,800 before
    # its crop; none where it has the size already, which PIL would copy) and its tile.
    resizes = record_resizes(monkeypatch)
    tile = llava.prepare_image(Image.new("RGB", size)).pixels  # [1, 3, side, side]
    assert all(before != after for before, after in resizes)
    resized = sum(w * h for _, (w, h) in resizes)
    assert llava.image_prepared_pixels(*size) == resized + tile[:, 0].numel()


def _palette_picture(colours: int) -> Image.Image:
    """A 47 x 29 picture of `colours` random palette entries: what a GIF can hold exactly."""
    generator = torch.Generator().manual_seed(0)
    indices = torch.randint(0, colours, (29, 47), generator=generator, dtype=torch.uint8)
    picture = Image.fromarray(indices.numpy(), "P")
    picture.putpalette(torch.randint(0, 256, (3 * colours,), generator=generator).tolist())
    return picture


@pytest.mark.parametrize(
    ("colours", "options"),
    [(256, {}), (256, {"transparency": 7}), (16, {}), (3, {})],
    ids=["256 colours", "a transparent index", "16 colours", "3 colours (a table padded to 4)"],
)
def test_a_gif_gives_the_rows_of_the_same_picture_as_a_png(
    colours: int, options: dict[str, int], tiny_llava: Path
) -> None:
    # GIF is taken since 741cd35: its palette and transparency must reach the tower as a PNG's do.
    from tandem.encoder.vision.image_bytes import decode_image

    picture = _palette_picture(colours)
    embedder = VisionLanguageEmbedder.load(tiny_llava, torch.float32)
    rows = {}
    for image_format in ("GIF", "PNG"):
        out = io.BytesIO()
        picture.save(out, image_format, **options)
        decoded = decode_image(out.getvalue(), 1 << 20, 1 << 20)
        rows[image_format] = embedder.embed_images([embedder.prepare_image(decoded)])[0]
    assert torch.equal(rows["GIF"], rows["PNG"])


def test_a_checkpoint_whose_image_placeholder_is_over_its_bound_is_refused_at_load_naming_it(
    tiny_llava: Path, tmp_path: Path
) -> None:
    """Every Embed reply of an image carries the placeholder within RESPONSE_OVERHEAD_BYTES, so one of
    any length from tokenizer.json could take replies near --max-message-bytes past gRPC's cap."""
    model_dir = tmp_path / "long-placeholder"
    model_dir.mkdir()
    for path in tiny_llava.iterdir():
        (model_dir / path.name).symlink_to(path)
    tokenizer = json.loads((tiny_llava / "tokenizer.json").read_text())
    [added] = [token for token in tokenizer["added_tokens"] if token["content"] == IMAGE_TOKEN]
    # Bytes, not characters: a 3-byte character, so the string is far shorter than the bytes it takes.
    wide = (MAX_IMAGE_PLACEHOLDER_BYTES - 1) // 3
    added["content"] = "<" + "\u56f3" * wide + "i" * (MAX_IMAGE_PLACEHOLDER_BYTES - 1 - 3 * wide) + ">"
    assert len(added["content"].encode()) == MAX_IMAGE_PLACEHOLDER_BYTES + 1  # one byte over
    (model_dir / "tokenizer.json").unlink()
    (model_dir / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(EmbedderLoadError) as error:
        VisionLanguageEmbedder.load(model_dir, torch.float32)
    assert str(error.value) == (
        f"tokenizer.json in {model_dir}: the image placeholder, token {added['id']} (config.json's "
        f"image_token_index), is {MAX_IMAGE_PLACEHOLDER_BYTES + 1} bytes, over the "
        f"{MAX_IMAGE_PLACEHOLDER_BYTES} an image placeholder may take (every Embed reply of an image "
        "carries it)"
    )
    at_bound = "\u56f3" * (wide - 1)
    added["content"] = "<" + at_bound + "i" * (MAX_IMAGE_PLACEHOLDER_BYTES - 2 - len(at_bound.encode())) + ">"
    assert len(added["content"].encode()) == MAX_IMAGE_PLACEHOLDER_BYTES
    (model_dir / "tokenizer.json").write_text(json.dumps(tokenizer))
    assert VisionLanguageEmbedder.load(model_dir, torch.float32).info.image_placeholder == added["content"]
