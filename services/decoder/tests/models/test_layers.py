from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

from tandem.decoder.models.config import Llama3RopeScaling
from tandem.decoder.models.layers import RMSNorm, RotaryEmbedding, merge_prompt_embeds, rope_inv_freq


def test_merge_prompt_embeds_returns_h_itself_when_there_are_no_embeddings() -> None:
    h = torch.randn(3, 8)
    assert merge_prompt_embeds(h, None, None) is h
    assert merge_prompt_embeds(h, torch.randn(3, 8), None) is h
    assert merge_prompt_embeds(h, None, torch.ones(3, dtype=torch.bool)) is h


def test_merge_prompt_embeds_takes_the_embedding_rows_where_flags_are_false() -> None:
    h = torch.randn(4, 8).bfloat16()
    embeds = torch.randn(4, 8).bfloat16()  # already in the model dtype, as the runner sends them
    is_token_ids = torch.tensor([True, False, False, True])
    merged = merge_prompt_embeds(h, embeds, is_token_ids)
    assert merged.dtype == torch.bfloat16
    assert torch.equal(merged[[0, 3]], h[[0, 3]])
    assert torch.equal(merged[[1, 2]], embeds[[1, 2]])


def test_merge_prompt_embeds_with_dummy_inputs_is_bitwise_the_token_path() -> None:
    h = torch.randn(5, 8).bfloat16()
    merged = merge_prompt_embeds(h, torch.zeros(5, 8, dtype=torch.bfloat16), torch.ones(5, dtype=torch.bool))
    assert torch.equal(merged, h)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_transformers_bitwise(dtype: torch.dtype) -> None:
    x = torch.randn(6, 32, dtype=dtype) * 3
    ours, ref = RMSNorm(32, 1e-6), LlamaRMSNorm(32, eps=1e-6)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(32))
        ref.weight.copy_(ours.weight)
    ours, ref = ours.to(dtype), ref.to(dtype)
    assert torch.equal(ours(x), ref(x))


def test_default_rope_frequencies_match_transformers() -> None:
    config = LlamaConfig(hidden_size=256, num_attention_heads=4, rope_theta=1e6)
    ref, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    assert torch.equal(rope_inv_freq(64, 1e6, None), ref)


def test_llama3_rope_scaling_matches_transformers() -> None:
    scaling = Llama3RopeScaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
    )
    config = LlamaConfig(
        hidden_size=4096,
        num_attention_heads=32,
        rope_scaling={"rope_type": "llama3", "rope_theta": 500000.0, **scaling.__dict__},
    )
    ref, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](config)
    ours = rope_inv_freq(128, 500000.0, scaling)
    assert attention_factor == 1.0
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=0)
    # The scaling changes the low frequencies and leaves the high ones alone.
    plain = rope_inv_freq(128, 500000.0, None)
    assert torch.equal(ours[:8], plain[:8]) and not torch.equal(ours[-8:], plain[-8:])


def test_rotary_angles_depend_on_each_token_position_only() -> None:
    rotary = RotaryEmbedding(16, 10000.0, None)
    packed_cos, packed_sin = rotary(torch.tensor([0, 1, 2, 0, 1], dtype=torch.int32), torch.float32)
    alone_cos, alone_sin = rotary(torch.tensor([0, 1]), torch.float32)
    assert torch.equal(packed_cos[3:], alone_cos) and torch.equal(packed_sin[3:], alone_sin)
