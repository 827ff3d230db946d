"""LLaVA's image half in every configuration its config.json can name, against transformers'
`get_image_features` on the same checkpoint (float32, random weights)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image

from services.encoder.tests.vision_checkpoints import make_image, make_llava
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
