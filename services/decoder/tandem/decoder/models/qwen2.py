"""Qwen2 and Qwen2.5: Llama's layer with biases on the q, k and v projections and none on o_proj.

transformers' Qwen2Attention builds q/k/v_proj with bias=True and o_proj with bias=False whatever
config.json says (models/config.py reads it so); there is no per-head norm. Small checkpoints (0.5B,
1.5B) tie the head to the token table, which `transformer.py` honours. A sliding window, off in every
released model, is refused where it would bite (engine/step/sizing.py).
"""

from __future__ import annotations

from typing import ClassVar

from tandem.decoder.models.transformer import DecoderModel


class Qwen2ForCausalLM(DecoderModel):
    use_qk_norm: ClassVar[bool] = False
