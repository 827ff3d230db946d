"""LLaVA's image half: a CLIP or SigLIP tower, one of its layers' rows, and the two-layer projector.

As transformers' `LlavaModel.get_image_features`: the tower's hidden states at `vision_feature_layer`
(an index, or a list whose rows are joined side by side), the class row dropped under the "default"
selection strategy, then `multi_modal_projector` (linear_1, the activation, linear_2) into the
language model's width. One image is one tile, and its span is `num_rows` image tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tandem.common import vision_language
from tandem.encoder.vision.image_span import PreparedImage
from tandem.encoder.vision.preprocess import ImageProcessing
from tandem.encoder.vision.vit import ACTIVATIONS, VisionTower, VitConfig
from tandem.encoder.vision.weights import load_module, read_prefixed

# Where transformers has put the tower and the projector (newest first), and the tower's own prefix
# inside (CLIPVisionModel wraps its transformer as `vision_model`).
TOWER_PREFIXES = (
    "model.vision_tower.vision_model.",
    "model.vision_tower.",
    "vision_tower.vision_model.",
    "vision_tower.",
)
PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")


class _Projector(nn.Module):
    def __init__(self, in_features: int, out_features: int, act: str, bias: bool) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_features, out_features, bias=bias)
        self.linear_2 = nn.Linear(out_features, out_features, bias=bias)
        self.act = ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaVision:
    """Pixels -> image rows in the language model's space."""

    def __init__(
        self,
        tower: VisionTower,
        projector: nn.Module,
        processing: ImageProcessing,
        feature_layers: list[int],
        drop_class_row: bool,
        image_token_id: int,
    ) -> None:
        self.tower = tower
        self.projector = projector
        self.processing = processing
        self.feature_layers = feature_layers  # indices into hidden_states, non-negative
        self.drop_class_row = drop_class_row
        self.image_token_id = image_token_id
        has_class_row = tower.config.flavour == "clip"
        self.num_rows = tower.config.num_patches + int(has_class_row) - int(drop_class_row)

    @classmethod
    def load(
        cls,
        hf_config: dict[str, Any],
        processor_config: dict[str, Any],
        files: dict[str, Path],
        text_hidden_size: int,
        image_token_id: int,
        dtype: torch.dtype,
        error: Callable[[str], Exception],
    ) -> LlavaVision:
        vit = VitConfig.from_hf(vision_language.vision_config(hf_config, error), error)
        processing = ImageProcessing.from_hf(processor_config, error)
        if processing.output_size() != (vit.image_size, vit.image_size):
            raise error(
                f"preprocessor_config.json makes {processing.output_size()} images; the tower reads "
                f"{vit.image_size} x {vit.image_size}"
            )
        layer = hf_config.get("vision_feature_layer", -2)
        layers = [layer] if isinstance(layer, int) else list(layer)
        if not layers or any(not -(vit.num_layers + 1) <= i <= vit.num_layers for i in layers):
            raise error(
                f"config.json: vision_feature_layer {layer!r} is outside the tower's {vit.num_layers} layers"
            )
        strategy = hf_config.get("vision_feature_select_strategy", "default")
        if strategy not in ("default", "full"):
            raise error(f"config.json: vision_feature_select_strategy {strategy!r} is not supported")
        act = hf_config.get("projector_hidden_act", "gelu")
        if act not in ACTIVATIONS:
            raise error(f"config.json: projector_hidden_act {act!r} is not supported ({sorted(ACTIVATIONS)})")
        with torch.device("meta"):
            tower = VisionTower(vit)
            projector = _Projector(
                vit.hidden_size * len(layers),
                text_hidden_size,
                act,
                bool(hf_config.get("multimodal_projector_bias", True)),
            )
        # A tower's head and post-norm feed only CLIP's pooled row: LLaVA never reads them.
        _, tower_state = read_prefixed(files, TOWER_PREFIXES, error)
        tower_state = {k: v for k, v in tower_state.items() if not k.startswith("head.")}
        load_module(tower, tower_state, "vision tower: ", error)
        _, projector_state = read_prefixed(files, PROJECTOR_PREFIXES, error)
        load_module(projector, projector_state, "multi_modal_projector: ", error)
        return cls(
            tower.to(dtype).train(False).requires_grad_(False),
            projector.to(dtype).train(False).requires_grad_(False),
            processing,
            [i % (vit.num_layers + 1) for i in layers],
            strategy == "default",  # transformers drops row 0 under "default" whatever the tower
            image_token_id,
        )

    @property
    def tile_shape(self) -> tuple[int, int, int]:
        side = self.tower.config.image_size
        return (self.tower.config.num_channels, side, side)

    def describe(self) -> str:
        layers = " and ".join(str(i) for i in self.feature_layers)
        return (
            f"LLaVA: {self.tower.config.describe()}, its layer {layers} output through the MLP projector, "
            f"{self.num_rows} rows per image"
        )

    def span_size(self, width: int, height: int) -> int:
        """num_rows, once the processor takes a picture of this size (InvalidArgument if not)."""
        self.processing.resized_size(width, height)
        return self.num_rows

    def prepared_pixels(self, width: int, height: int) -> int:
        """VisionModel.prepared_pixels: the shortest-edge resize's (LLaVA-1.5: 336 x 99,792 for 1 x 297)
        and its one tile's."""
        resized = self.processing.resized_size(width, height) or (width, height)
        tile_height, tile_width = self.processing.output_size() or resized[::-1]
        return (0 if resized == (width, height) else resized[0] * resized[1]) + tile_height * tile_width

    def prepare(self, image: Any) -> PreparedImage:
        """One PIL image -> its pixels (one tile) and its span: num_rows image tokens."""
        pixels = self.processing(image)[None]  # [1, 3, side, side]
        return PreparedImage(pixels, [self.image_token_id] * self.num_rows)

    @torch.inference_mode()
    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """[tiles, 3, side, side] -> [tiles, num_rows, text hidden]."""
        states = self.tower.hidden_states(pixels, up_to=max(self.feature_layers))
        selected = torch.cat([states[i] for i in self.feature_layers], dim=-1)
        if self.drop_class_row:
            selected = selected[:, 1:]
        return self.projector(selected)
