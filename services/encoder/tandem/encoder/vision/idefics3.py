"""SmolVLM's (Idefics3's) image half: tiles through a SigLIP tower, pixel shuffle, one linear map.

As transformers' `Idefics3Model.get_image_features`: each tile (see idefics3_preprocess.py) goes
through the vision transformer, post_layernorm included; the connector's pixel shuffle folds every
`scale_factor` x `scale_factor` block of patch rows into one row `scale_factor ** 2` times as wide,
and `modality_projection.proj` (a Linear without bias) maps it into the language model's width. A
tile of n x n patches gives (n / scale_factor) ** 2 rows, `image_seq_len`.

The span is what Idefics3Processor writes for one `<image>`: for a grid of tiles, per tile
`<fake_token_around_image><row_i_col_j>` and its image tokens, a newline after each row, then a
newline and `<fake_token_around_image><global-img>`, the global image's tokens and a closing
`<fake_token_around_image>`; for one unsplit tile, only the global part. It is tokenized whole by the
checkpoint's tokenizer, as the processor tokenizes it within the prompt (the markers are added tokens,
so the newlines between them tokenize as they do in context).

Idefics3's vision embeddings place a tile's patches on the position table by bucketizing their
fractional coordinates (NaViT-style, for tiles of any shape). For the full square tiles the processor
makes, that is a fixed map from patch to position row; it is `arange` for most sizes but not all
(float rounding: 25, 38 or 41 patches a side move some patches to a neighbouring row), so the map is
computed once here, exactly as transformers computes it, and the position table reordered by it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from tokenizers import Tokenizer
from torch import nn

from tandem.common import vision_language
from tandem.encoder.vision.idefics3_preprocess import Idefics3Processing
from tandem.encoder.vision.image_span import PreparedImage
from tandem.encoder.vision.vit import VisionTower, VitConfig
from tandem.encoder.vision.weights import load_module, read_prefixed

# Where transformers puts the tower and the connector: under Idefics3ForConditionalGeneration's
# `model.`, or at the top of a bare Idefics3Model's checkpoint.
TOWER_PREFIXES = ("model.vision_model.", "vision_model.")
CONNECTOR_PREFIXES = ("model.connector.", "connector.")

FAKE_TOKEN = "<fake_token_around_image>"
GLOBAL_TOKEN = "<global-img>"
IMAGE_TOKEN = "<image>"  # Idefics3Processor writes this literal string


def row_col_token(row: int, col: int) -> str:
    """The marker before tile (row, col) of the grid, both counted from 0."""
    return f"<row_{row + 1}_col_{col + 1}>"


def span_text(rows: int, cols: int, image_seq_len: int) -> str:
    """Idefics3Processor's replacement for one `<image>` whose tiles form a rows x cols grid (0 x 0:
    not split)."""
    image_tokens = IMAGE_TOKEN * image_seq_len
    global_part = f"{FAKE_TOKEN}{GLOBAL_TOKEN}{image_tokens}{FAKE_TOKEN}"
    if rows == 0 and cols == 0:
        return global_part
    grid = "".join(
        "".join(f"{FAKE_TOKEN}{row_col_token(r, c)}{image_tokens}" for c in range(cols)) + "\n"
        for r in range(rows)
    )
    return f"{grid}\n{global_part}"


def bucket_positions(patches_per_side: int) -> torch.Tensor:
    """The position row of each patch of a full square tile, as Idefics3VisionEmbeddings computes it
    with an all-ones patch mask (same float32 steps on the CPU): [patches_per_side ** 2] long."""
    n = patches_per_side
    boundaries = torch.arange(1 / n, 1.0, 1 / n)
    step = 1.0 / torch.tensor([n])  # float32, as 1.0 / the mask's row count is there
    fractional = torch.clamp(torch.arange(n, dtype=torch.float32)[None, :] * step[:, None], max=1.0 - 1e-6)
    buckets = torch.bucketize(fractional, boundaries, right=True)[0]  # [n]
    return (buckets[:, None] * n + buckets[None, :]).reshape(-1)


def pixel_shuffle(x: torch.Tensor, scale_factor: int) -> torch.Tensor:
    """Idefics3Connector.pixel_shuffle: [tiles, n * n, width] -> [tiles, (n / s) ** 2, width * s * s],
    step for step (the row order of its result is what the model was trained on)."""
    tiles, seq, width = x.shape
    side = int(seq**0.5)
    s = scale_factor
    x = x.view(tiles, side, side, width)
    x = x.view(tiles, side, side // s, width * s)
    x = x.permute(0, 2, 1, 3)
    x = x.reshape(tiles, side // s, side // s, width * s * s)
    x = x.permute(0, 2, 1, 3)
    return x.reshape(tiles, seq // (s * s), width * s * s)


class _Connector(nn.Module):
    """Idefics3Connector's weights: `modality_projection.proj.weight`."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.modality_projection = nn.Module()
        self.modality_projection.proj = nn.Linear(in_features, out_features, bias=False)


class Idefics3Vision:
    """Pixels -> image rows in the language model's space, and each image's span of tokens."""

    def __init__(
        self,
        tower: VisionTower,
        connector: _Connector,
        processing: Idefics3Processing,
        scale_factor: int,
        tokenizer: Tokenizer,
        image_token_id: int,
    ) -> None:
        self.tower = tower
        self.connector = connector
        self.processing = processing
        self.scale_factor = scale_factor
        self.tokenizer = tokenizer
        self.image_token_id = image_token_id
        self.image_seq_len = tower.config.num_patches // scale_factor**2
        self._spans: dict[tuple[int, int], list[int]] = {}  # (rows, cols) -> span token IDs

    @classmethod
    def load(
        cls,
        hf_config: dict[str, Any],
        processor_config: dict[str, Any],
        files: dict[str, Path],
        tokenizer: Tokenizer,
        image_token_id: int,
        dtype: torch.dtype,
        error: Callable[[str], Exception],
    ) -> Idefics3Vision:
        vision = vision_language.vision_config(hf_config, error)
        if vision["model_type"] != "idefics3_vision":
            raise error(
                f"config.json: vision_config model_type {vision['model_type']!r} is not idefics3_vision"
            )
        vit = VitConfig.from_hf(vision, error)
        processing = Idefics3Processing.from_hf(processor_config, error)
        if processing.tile != vit.image_size:
            # A tile of another size would reach the tower as a patch grid it would bucketize onto its
            # position table (and pixel-shuffle) differently from the full square tile computed here.
            raise error(
                f"preprocessor_config.json: max_image_size longest_edge {processing.tile} is not the vision "
                f"tower's image_size {vit.image_size}"
            )
        scale_factor = hf_config.get("scale_factor", 2)
        side = vit.image_size // vit.patch_size
        if not isinstance(scale_factor, int) or scale_factor < 1 or side % scale_factor:
            raise error(
                f"config.json: scale_factor {scale_factor!r} does not divide the tower's {side} patches "
                "a side"
            )
        text_hidden = vision_language.text_config(hf_config, error)["hidden_size"]
        _check_markers(tokenizer, image_token_id, processing.max_grid_side(), error)
        with torch.device("meta"):
            tower = VisionTower(vit)
            connector = _Connector(vit.hidden_size * scale_factor**2, text_hidden)
        _, tower_state = read_prefixed(files, TOWER_PREFIXES, error)
        table = tower_state.get("embeddings.position_embedding.weight")
        if table is not None and table.shape[0] == side * side:
            # Each patch's row of the table, where transformers' bucketized positions put it.
            tower_state["embeddings.position_embedding.weight"] = table[bucket_positions(side)]
        load_module(tower, tower_state, "vision_model: ", error)
        _, connector_state = read_prefixed(files, CONNECTOR_PREFIXES, error)
        load_module(connector, connector_state, "connector: ", error)
        return cls(
            tower.to(dtype).train(False).requires_grad_(False),
            connector.to(dtype).train(False).requires_grad_(False),
            processing,
            scale_factor,
            tokenizer,
            image_token_id,
        )

    @property
    def tile_shape(self) -> tuple[int, int, int]:
        side = self.tower.config.image_size
        return (self.tower.config.num_channels, side, side)

    def describe(self) -> str:
        tiles = "tiles and a global image" if self.processing.splitting else "one tile"
        return (
            f"SmolVLM (Idefics3): {self.tower.config.describe()}, pixel shuffle x{self.scale_factor} "
            f"and connector, {self.image_seq_len} rows per tile ({tiles} per image)"
        )

    def span_size(self, width: int, height: int) -> int:
        """The span's length for a picture of this size: its grid's (InvalidArgument if none)."""
        return len(self._span(*self.processing.grid(width, height)))

    def prepared_pixels(self, width: int, height: int) -> int:
        """VisionModel.prepared_pixels: each resize's, the global image's included (a 1 x 1 picture grows
        to longest_edge squared), and its tiles' (SmolVLM-256M: up to 17 of 512 x 512, 40-65% of its
        preparation)."""
        rows, cols = self.processing.grid(width, height)
        num_tiles = rows * cols + 1 if (rows, cols) != (0, 0) else 1  # the grid, then the global image
        return self.processing.resized_pixels(width, height) + num_tiles * self.processing.tile**2

    def prepare(self, image: Image.Image) -> PreparedImage:
        """One PIL image -> its tiles (the grid row by row, then the global image) and its span."""
        tiles = self.processing(image)
        return PreparedImage(tiles.pixels, self._span(tiles.rows, tiles.cols))

    def _span(self, rows: int, cols: int) -> list[int]:
        span = self._spans.get((rows, cols))
        if span is None:
            span = self.tokenizer.encode(
                span_text(rows, cols, self.image_seq_len), add_special_tokens=False
            ).ids
            expected = (rows * cols + 1) * self.image_seq_len
            if span.count(self.image_token_id) != expected:  # the markers were checked at load
                raise ValueError(
                    f"span of a {rows} x {cols} grid tokenizes to {span.count(self.image_token_id)} "
                    f"image tokens, not {expected}"
                )
            self._spans[(rows, cols)] = span
        return list(span)

    @torch.inference_mode()
    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """[tiles, 3, side, side] -> [tiles, image_seq_len, text hidden]."""
        states = self.tower.last_hidden_state(pixels)  # [tiles, patches, vision hidden]
        shuffled = pixel_shuffle(states, self.scale_factor)  # [tiles, image_seq_len, vision hidden * s * s]
        return self.connector.modality_projection.proj(shuffled)  # [tiles, image_seq_len, text hidden]


def _check_markers(
    tokenizer: Tokenizer, image_token_id: int, max_grid_side: int, error: Callable[[str], Exception]
) -> None:
    """Every marker the span can hold is one token of the tokenizer, recognized as such in text (an
    added token), and `<image>` is the config's image token."""
    markers = [FAKE_TOKEN, GLOBAL_TOKEN, IMAGE_TOKEN]
    markers += [row_col_token(r, c) for r in range(max_grid_side) for c in range(max_grid_side)]
    for marker in markers:
        token_id = tokenizer.token_to_id(marker)
        if token_id is None:
            raise error(f"tokenizer.json has no {marker!r} token, which Idefics3's image prompts need")
        if tokenizer.encode(marker, add_special_tokens=False).ids != [token_id]:
            raise error(f"tokenizer.json: {marker!r} is not an added token (text containing it splits it)")
    if tokenizer.token_to_id(IMAGE_TOKEN) != image_token_id:
        raise error(
            f"config.json: image_token_id {image_token_id} is not the tokenizer's {IMAGE_TOKEN!r} "
            f"({tokenizer.token_to_id(IMAGE_TOKEN)})"
        )
