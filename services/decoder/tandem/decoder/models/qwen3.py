"""Qwen3 (dense): the shared decoder stack with per-head RMSNorm on queries and keys before RoPE.

Everything else (GQA, SwiGLU, tied or untied head, head_dim taken from the config) is in
`transformer.py`; the checkpoint's `attention_bias` is honoured there.
"""

from __future__ import annotations

from typing import ClassVar

from tandem.decoder.models.transformer import DecoderModel


class Qwen3ForCausalLM(DecoderModel):
    use_qk_norm: ClassVar[bool] = True
