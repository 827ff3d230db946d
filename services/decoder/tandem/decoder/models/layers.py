"""Building blocks shared by the decoder models: RMSNorm, RoPE, the SwiGLU MLP, the prompt-embeds merge.

Numerics follow the Hugging Face reference implementations (fp32 norm statistics, fp32 RoPE angles
cast to the model dtype) so that checkpoints give the same tokens here and there.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tandem.decoder.models.config import Llama3RopeScaling
from tandem.decoder.models.linear import Linear, Projection
from tandem.decoder.models.lora import LayerLora
from tandem.decoder.models.tensor_parallel import (
    ParallelGroup,
    gather_sequence,
    row_parallel,
    world_size_of,
)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))  # [size]
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., size]. The mean of squares is taken in fp32: in bf16 it loses most of its bits.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_inv_freq(
    head_dim: int, theta: float, scaling: Llama3RopeScaling | None, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Rotation frequency of each pair of dimensions. Returns fp32 [head_dim // 2]."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)  # [head_dim // 2]
    if scaling is None:
        return inv_freq
    # Llama 3.x: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    low_freq_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin of each token's rotation angles, from per-token positions (so packed sequences work)."""

    def __init__(self, head_dim: int, theta: float, scaling: Llama3RopeScaling | None) -> None:
        super().__init__()
        # Computed on the host even when the model is built on the meta device, so loading weights
        # with assign=True leaves nothing to re-initialise; moving the model moves it too.
        inv_freq = rope_inv_freq(head_dim, theta, scaling, device="cpu")  # [head_dim // 2]
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [num_tokens] -> cos, sin: [num_tokens, 1, head_dim] in `dtype`, broadcast over heads.
        # No table of every position: computing the angles per step costs less than a 128k-row cache.
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [num_tokens, head_dim // 2]
        angles = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [num_tokens, 1, head_dim]
        return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates the two halves of each head (the Hugging Face "rotate_half" layout)."""
    # x: [num_tokens, num_heads, head_dim]; cos, sin: [num_tokens, 1, head_dim]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class SwiGLU(nn.Module):
    """gate/up column-parallel, down row-parallel: each rank holds intermediate_size / world_size."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, bias: bool, tp: ParallelGroup | None = None
    ) -> None:
        super().__init__()
        self.tp = tp
        local_size = intermediate_size // world_size_of(tp)
        # gate_proj and up_proj as one GEMM; the loader concatenates the checkpoint's two matrices.
        self.gate_up_proj = Linear(hidden_size, 2 * local_size, bias=bias)
        self.down_proj = Linear(local_size, hidden_size, bias=bias)

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden_size], or this rank's [local_len, hidden_size] under SP
        sp: bool = False,
        lora: LayerLora | None = None,
        gate_up_proj: Projection | None = None,  # a kernel bound to gate_up_proj (models/kernels.py)
        down_proj: Projection | None = None,  # a kernel bound to down_proj
    ) -> torch.Tensor:
        x = gather_sequence(x, self.tp, sp)  # [num_tokens, hidden_size]
        gate_up = (gate_up_proj or self.gate_up_proj)(x)  # [num_tokens, 2 * local_size]
        if lora is not None:
            gate_up = lora.gate_up_proj(x, gate_up)
        gate, up = gate_up.chunk(2, dim=-1)  # 2 x [num_tokens, local_size]
        down_delta = None if lora is None else lora.down_proj
        return row_parallel(down_proj or self.down_proj, F.silu(gate) * up, self.tp, sp, down_delta)


def merge_prompt_embeds(
    h: torch.Tensor, inputs_embeds: torch.Tensor | None, is_token_ids: torch.Tensor | None
) -> torch.Tensor:
    """Replaces the rows of `h` whose position carries an embedding instead of a token ID.

    h: [num_tokens, hidden_size] token embeddings; inputs_embeds: [num_tokens, hidden_size] in h's
    dtype (request building casts embedding rows to the model dtype, once); is_token_ids: bool
    [num_tokens], True keeps the row of `h`. With all-True flags the result is `h` bit for bit, so
    static-shape warmup with dummy inputs matches the token path.
    """
    if inputs_embeds is None or is_token_ids is None:
        return h
    return torch.where(is_token_ids[:, None], h, inputs_embeds)
