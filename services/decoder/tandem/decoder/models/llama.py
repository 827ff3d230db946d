"""Llama 2 and 3.x: the shared decoder stack as is.

What varies between Llama checkpoints is configuration, read in `config.py`: Llama 3.x RoPE scaling,
`attention_bias` / `mlp_bias`, and `head_dim` (absent in Llama 2 files: hidden_size / num_heads).
"""

from __future__ import annotations

from typing import ClassVar

from tandem.decoder.models.transformer import DecoderModel


class LlamaForCausalLM(DecoderModel):
    use_qk_norm: ClassVar[bool] = False
