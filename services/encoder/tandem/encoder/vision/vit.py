"""The vision towers of LLaVA and SmolVLM: a ViT in CLIP's or SigLIP's flavour, read from safetensors.

Both are the same pre-norm transformer over image patches; they differ where the checkpoint says:
CLIP prepends a class row, has no bias on its patch convolution and a LayerNorm before the first
layer (`pre_layrnorm`, spelled as the checkpoints spell it); SigLIP has none of those. Both end
with `post_layernorm`, which transformers applies to SigLIP's last hidden state (what SmolVLM reads)
and only to CLIP's pooled row (which LLaVA never reads). LLaVA reads an intermediate layer's output,
so `hidden_states` returns every layer's.

Numerics follow transformers' modules step for step (float32 tests agree within 1e-5): attention
through torch's scaled_dot_product_attention, activations as named in the vision config.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),  # CLIP's
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),  # SigLIP's
    "gelu": F.gelu,  # exact (erf)
}


@dataclass(frozen=True)
class VitConfig:
    """A vision config.json section (`vision_config`), as far as the tower needs it."""

    flavour: str  # "clip" or "siglip"
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int  # square input side the position table was trained for
    patch_size: int
    num_channels: int
    layer_norm_eps: float
    hidden_act: str

    def describe(self) -> str:
        """What a log line says of the tower: "CLIP vision tower (24 layers, 1024 wide, ...)"."""
        return (
            f"{self.flavour.upper() if self.flavour == 'clip' else 'SigLIP'} vision tower ({self.num_layers} "
            f"layers, {self.hidden_size} wide, {self.image_size} px input in {self.patch_size} px patches)"
        )

    @classmethod
    def from_hf(cls, vision: dict[str, Any], error: Callable[[str], Exception]) -> VitConfig:
        """From a vision_config with its defaults filled in (vision_language.vision_config)."""
        model_type = vision["model_type"]
        flavour = "clip" if model_type == "clip_vision_model" else "siglip"  # SigLIP's and Idefics3's
        hidden_act = vision["hidden_act"]
        if hidden_act not in ACTIVATIONS:
            raise error(
                f"config.json: vision hidden_act {hidden_act!r} is not supported ({sorted(ACTIVATIONS)})"
            )
        try:
            config = cls(
                flavour=flavour,
                hidden_size=int(vision["hidden_size"]),
                intermediate_size=int(vision["intermediate_size"]),
                num_layers=int(vision["num_hidden_layers"]),
                num_heads=int(vision["num_attention_heads"]),
                image_size=int(vision["image_size"]),
                patch_size=int(vision["patch_size"]),
                num_channels=int(vision.get("num_channels", 3)),
                layer_norm_eps=float(vision["layer_norm_eps"]),
                hidden_act=hidden_act,
            )
        except (KeyError, TypeError, ValueError) as e:
            raise error(f"config.json: vision_config: missing or malformed {e}") from None
        if min(config.hidden_size, config.num_layers, config.num_heads, config.patch_size) < 1:
            raise error("config.json: vision_config sizes must be positive")
        if config.hidden_size % config.num_heads or config.image_size % config.patch_size:
            raise error(
                "config.json: vision_config: hidden_size must be a multiple of num_attention_heads and "
                "image_size of patch_size"
            )
        return config

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


class _Attention(nn.Module):
    def __init__(self, config: VitConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        width = config.hidden_size
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(width, width) for _ in range(3))
        self.out_proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [batch, rows, width]
        batch, rows, width = x.shape
        head_dim = width // self.num_heads

        def heads(t: torch.Tensor) -> torch.Tensor:  # [batch, heads, rows, head_dim]
            return t.view(batch, rows, self.num_heads, head_dim).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        out = F.scaled_dot_product_attention(q, k, v, scale=1 / math.sqrt(head_dim))
        return self.out_proj(out.transpose(1, 2).reshape(batch, rows, width))


class _Mlp(nn.Module):
    def __init__(self, config: VitConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class _Layer(nn.Module):
    def __init__(self, config: VitConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = _Attention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = _Mlp(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class _Encoder(nn.Module):
    def __init__(self, config: VitConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer(config) for _ in range(config.num_layers))


class _Embeddings(nn.Module):
    def __init__(self, config: VitConfig) -> None:
        super().__init__()
        is_clip = config.flavour == "clip"
        self.patch_embedding = nn.Conv2d(
            config.num_channels, config.hidden_size, config.patch_size, config.patch_size, bias=not is_clip
        )
        self.class_embedding = nn.Parameter(torch.empty(config.hidden_size)) if is_clip else None
        self.position_embedding = nn.Embedding(config.num_patches + int(is_clip), config.hidden_size)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:  # [batch, channels, side, side]
        patches = self.patch_embedding(pixels).flatten(2).transpose(1, 2)  # [batch, num_patches, width]
        if self.class_embedding is not None:
            cls = self.class_embedding.expand(patches.shape[0], 1, -1)
            patches = torch.cat([cls, patches], dim=1)
        return patches + self.position_embedding.weight


class VisionTower(nn.Module):
    """Pixels [batch, channels, image_size, image_size] -> rows; parameter names as in the checkpoint."""

    def __init__(self, config: VitConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = _Embeddings(config)
        is_clip = config.flavour == "clip"
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, config.layer_norm_eps) if is_clip else None
        self.encoder = _Encoder(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def hidden_states(self, pixels: torch.Tensor, up_to: int | None = None) -> list[torch.Tensor]:
        """The tower's input rows and each layer's output: num_layers + 1 of [batch, rows, width].
        With `up_to`, the layers after that index are skipped (LLaVA reads the second-to-last)."""
        x = self.embeddings(pixels.to(self.embeddings.patch_embedding.weight.dtype))
        if self.pre_layrnorm is not None:
            x = self.pre_layrnorm(x)
        states = [x]
        for layer in self.encoder.layers[: up_to if up_to is not None else None]:
            x = layer(x)
            states.append(x)
        return states

    def last_hidden_state(self, pixels: torch.Tensor) -> torch.Tensor:
        """SigLIP's output as SmolVLM reads it: the last layer's, through post_layernorm."""
        return self.post_layernorm(self.hidden_states(pixels)[-1])
