"""SmolVLM's (Idefics3's) image half against transformers, on tiny random checkpoints.

What the encoder makes of one image must be what `Idefics3ForConditionalGeneration` feeds its
language model for the same picture file:

- the tiles are `Idefics3ImageProcessorPil`'s pixel values, every tile and in its order (the grid row
  by row, then the global image), with splitting and without;
- the span is `Idefics3Processor`'s expansion of one `<image>` in a prompt, token for token;
- the span's rows are the model's `inputs_embeds` at those positions once the image features are
  merged in (`get_image_features`, then `inputs_merger`): the connector's rows where `<image>` is,
  the token table's everywhere else;
- images embedded together equal each one embedded alone;
- a checkpoint whose settings we cannot reproduce is refused at load time, naming the setting.

Two checkpoints: one that splits (32-pixel tiles of 4 x 4 patches, images first resized to a 64-pixel
longest edge: a 2 x 2 grid at most), one that does not (76-pixel tiles of 38 x 38 patches, a size whose
bucketized patch positions are not `arange`).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image
from tokenizers import Tokenizer

from services.encoder.tests.resizes import record_resizes
from services.encoder.tests.smolvlm_checkpoint import GLOBAL_TOKEN, make_smolvlm
from services.encoder.tests.vision_checkpoints import make_image, read_config
from tandem.common.torch_part.weight_files import weight_names
from tandem.encoder.embedder import EmbedderLoadError
from tandem.encoder.lookup import read_tokenizer
from tandem.encoder.vision.embedder import VisionLanguageEmbedder, processor_config
from tandem.encoder.vision.idefics3 import Idefics3Vision, bucket_positions

transformers = pytest.importorskip("transformers")

BEFORE, AFTER = "User: look", " what is it?"  # the prompt around the image
IMAGES = {  # name -> (width, height), PIL mode
    "landscape": ((100, 70), "RGB"),  # 2 x 2 grid
    "portrait": ((40, 100), "RGB"),  # 2 rows x 1 column
    "tiny": ((6, 4), "RGB"),  # upscaled to the longest edge, then split
    "transparent": ((50, 30), "RGBA"),  # composited onto white first
    # Resizes to the size a picture has are skipped (PIL would copy it): these take the skips, so that
    # skipping stays transformers' pixels. Split: both resizes (longest edge 64, tile multiple 64 x 64);
    # single: the longest-edge one (152).
    "square": ((64, 64), "RGB"),
    "longest edge": ((152, 60), "RGB"),
}


class Checkpoint:
    """A checkpoint directory, our embedder for it, and transformers' processor and model."""

    def __init__(self, model_dir: Path) -> None:
        self.dir = model_dir
        self.embedder = VisionLanguageEmbedder.load(model_dir, torch.float32)
        self.processor = transformers.AutoProcessor.from_pretrained(model_dir)
        self.model = transformers.Idefics3ForConditionalGeneration.from_pretrained(
            model_dir, dtype=torch.float32
        ).train(False)

    def reference(self, image: Image.Image) -> tuple[torch.Tensor, list[int], torch.Tensor]:
        """transformers' pixels [tiles, 3, side, side], the span's token IDs, and its rows of the
        merged inputs_embeds [span, hidden], for `image` in the prompt BEFORE <image> AFTER."""
        inputs = self.processor(text=f"{BEFORE}<image>{AFTER}", images=[image], return_tensors="pt")
        ids = inputs["input_ids"][0].tolist()
        before = self.processor.tokenizer(BEFORE)["input_ids"]
        after = self.processor.tokenizer(AFTER, add_special_tokens=False)["input_ids"]
        assert ids[: len(before)] == before and ids[len(ids) - len(after) :] == after
        start, end = len(before), len(ids) - len(after)
        with torch.no_grad():
            embeds = self.model.get_input_embeddings()(inputs["input_ids"])
            features = self.model.model.get_image_features(
                inputs["pixel_values"], inputs["pixel_attention_mask"]
            ).pooler_output
            merged = self.model.model.inputs_merger(inputs["input_ids"], embeds, torch.cat(list(features)))
        return inputs["pixel_values"][0], ids[start:end], merged[0, start:end]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Checkpoint]:
    root = tmp_path_factory.mktemp("smolvlm")
    return {
        "split": Checkpoint(make_smolvlm(root / "split", splitting=True)),
        "single": Checkpoint(make_smolvlm(root / "single", splitting=False, image_size=76, patch_size=2)),
    }


@pytest.fixture(scope="module")
def pictures(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pictures")
    return {
        name: make_image(root / f"{name}.png", size, seed=i, mode=mode)
        for i, (name, (size, mode)) in enumerate(IMAGES.items())
    }


@pytest.mark.parametrize("which", ["split", "single"])
@pytest.mark.parametrize("name", list(IMAGES))
def test_tiles_are_transformers_pixels(checkpoints, pictures, which: str, name: str) -> None:
    checkpoint = checkpoints[which]
    assert type(checkpoint.processor.image_processor).__name__ == "Idefics3ImageProcessorPil"
    ours = checkpoint.embedder.prepare_image(Image.open(pictures[name])).pixels
    expected = checkpoint.processor.image_processor(Image.open(pictures[name]), return_tensors="pt")
    expected_pixels = expected["pixel_values"][0]  # [tiles, 3, side, side]
    assert bool(expected["pixel_attention_mask"].all())  # one image: no tile is padded
    assert ours.dtype == torch.float32
    assert ours.shape == expected_pixels.shape
    assert ours.shape[1:] == checkpoint.embedder.vision.tile_shape
    assert torch.equal(ours, expected_pixels)


def test_splitting_makes_a_grid_and_the_global_image(checkpoints, pictures) -> None:
    tiles = {
        (which, name): checkpoints[which].embedder.prepare_image(Image.open(pictures[name])).pixels.shape[0]
        for which in checkpoints
        for name in ("landscape", "portrait")
    }
    assert tiles == {
        ("split", "landscape"): 5,
        ("split", "portrait"): 3,
        ("single", "landscape"): 1,
        ("single", "portrait"): 1,
    }


@pytest.mark.parametrize(
    ("which", "name", "made"),
    [
        ("split", "square", [((64, 64), (32, 32))]),  # the global image only
        ("single", "longest edge", [((152, 60), (76, 76))]),  # the tile only
    ],
)
def test_no_resize_to_the_size_a_picture_has_is_made(checkpoints, pictures, which, name, made, monkeypatch):
    resizes = record_resizes(monkeypatch)
    checkpoints[which].embedder.prepare_image(Image.open(pictures[name]))
    assert resizes == made


@pytest.mark.parametrize("which", ["split", "single"])
@pytest.mark.parametrize("name", ["landscape", "portrait", "tiny"])
def test_span_is_the_processors_expansion_of_one_image_token(checkpoints, pictures, which, name) -> None:
    checkpoint = checkpoints[which]
    _, expected_ids, _ = checkpoint.reference(Image.open(pictures[name]))
    assert checkpoint.embedder.prepare_image(Image.open(pictures[name])).token_ids == expected_ids


@pytest.mark.parametrize("which", ["split", "single"])
@pytest.mark.parametrize(
    "size", [(100, 70), (40, 100), (6, 4), (1, 1), (300, 1), (1, 90), (64, 64), (65, 33)]
)
def test_the_span_size_known_from_a_header_is_the_prepared_spans(checkpoints, which, size) -> None:
    embedder = checkpoints[which].embedder
    assert embedder.image_span_size(*size) == len(embedder.prepare_image(Image.new("RGB", size)).token_ids)


@pytest.mark.parametrize("which", ["split", "single"])
@pytest.mark.parametrize("size", [(100, 70), (1, 1), (300, 1), (64, 64), (32, 32)])
def test_the_pixels_the_preparation_makes_are_known_from_a_header(
    checkpoints, which, size, monkeypatch
) -> None:
    # What the batcher weighs a call by: every resize made, the global image's included (a 1 x 1
    # picture grows to longest_edge squared), and the tiles made into tensors (SmolVLM-256M: up to 17
    # of 512 x 512, 40-65% of a picture's preparation). None is to the size a picture has: PIL would
    # copy it (a square one's tile-multiple resize), no work to weigh.
    embedder = checkpoints[which].embedder
    resizes = record_resizes(monkeypatch)
    tiles = embedder.prepare_image(Image.new("RGB", size)).pixels  # [num_tiles, 3, side, side]
    assert all(before != after for before, after in resizes)
    resized = sum(w * h for _, (w, h) in resizes)
    assert embedder.image_prepared_pixels(*size) == resized + tiles[:, 0].numel()


@pytest.mark.parametrize("which", ["split", "single"])
@pytest.mark.parametrize("name", ["landscape", "portrait", "tiny", "square", "longest edge"])
def test_span_rows_are_transformers_merged_inputs_embeds(checkpoints, pictures, which, name) -> None:
    checkpoint = checkpoints[which]
    _, _, expected = checkpoint.reference(Image.open(pictures[name]))
    prepared = checkpoint.embedder.prepare_image(Image.open(pictures[name]))
    rows = checkpoint.embedder.embed_images([prepared])[0]
    assert rows.shape == expected.shape
    assert (rows - expected).abs().max().item() <= 1e-5


def test_images_embedded_together_equal_each_alone(checkpoints, pictures) -> None:
    embedder = checkpoints["split"].embedder
    landscape, portrait = (embedder.prepare_image(Image.open(pictures[n])) for n in ("landscape", "portrait"))
    assert landscape.pixels.shape[0] != portrait.pixels.shape[0]
    together = embedder.embed_images([landscape, portrait])
    alone = [embedder.embed_images([landscape])[0], embedder.embed_images([portrait])[0]]
    for both, one in zip(together, alone, strict=True):
        assert both.shape == one.shape
        assert (both - one).abs().max().item() <= 1e-5


def test_patch_positions_are_bucketized_as_transformers_does() -> None:
    # 4 patches a side land on the position table in order; 38 do not (float rounding moves one
    # column and one row of patches to the previous bucket), which the "single" checkpoint exercises.
    assert torch.equal(bucket_positions(4), torch.arange(16))
    assert (bucket_positions(38) != torch.arange(38 * 38)).sum() == 2 * 38 - 1


def _load(
    model_dir: Path, config=None, processing=None, tokenizer: Tokenizer | None = None
) -> Idefics3Vision:
    config = config if config is not None else read_config(model_dir)
    tokenizer = tokenizer if tokenizer is not None else read_tokenizer(model_dir)
    return Idefics3Vision.load(
        config,
        processing if processing is not None else processor_config(model_dir),
        weight_names(model_dir, EmbedderLoadError),
        tokenizer,
        config["image_token_id"],
        torch.float32,
        EmbedderLoadError,
    )


@pytest.mark.parametrize(
    ("key", "change"),
    [
        ("scale_factor", lambda config, processing: config.update(scale_factor=3)),
        ("max_image_size", lambda config, processing: processing.update(max_image_size={"longest_edge": 48})),
        ("size", lambda config, processing: processing.update(size={"height": 64, "width": 64})),
        ("do_resize", lambda config, processing: processing.update(do_resize=False)),
        ("resample", lambda config, processing: processing.update(resample=99)),
        (
            "image_processor_type",
            lambda config, processing: processing.update(image_processor_type="CLIPImageProcessor"),
        ),
    ],
)
def test_a_setting_we_cannot_reproduce_is_refused_by_name(checkpoints, key: str, change) -> None:
    model_dir = checkpoints["split"].dir
    config, processing = read_config(model_dir), processor_config(model_dir)
    _load(model_dir, config, processing)  # as written, it loads
    change(config, processing)
    with pytest.raises(EmbedderLoadError, match=key):
        _load(model_dir, config, processing)


def test_a_missing_marker_token_is_refused_by_name(checkpoints) -> None:
    model_dir = checkpoints["split"].dir
    tokenizer_json = json.loads((model_dir / "tokenizer.json").read_text())
    tokenizer_json["added_tokens"] = [
        t for t in tokenizer_json["added_tokens"] if t["content"] != GLOBAL_TOKEN
    ]
    tokenizer = Tokenizer.from_str(json.dumps(tokenizer_json))
    assert tokenizer.token_to_id(GLOBAL_TOKEN) is None
    with pytest.raises(EmbedderLoadError, match=GLOBAL_TOKEN):
        _load(model_dir, tokenizer=tokenizer)
