"""Mistral: Llama's layer, no bias anywhere, and a `sliding_window` on every layer's attention.

The window is null in v0.3 (the model attends to the whole context, as Llama does) and 4096 in v0.1.
It is not implemented: a checkpoint is served only where no sequence can outgrow it, the context
served (--max-model-len, else max_position_embeddings) no wider than the window, and refused at start
otherwise (engine/step/sizing.py).
"""

from __future__ import annotations

from typing import ClassVar

from tandem.decoder.models.transformer import DecoderModel


class MistralForCausalLM(DecoderModel):
    use_qk_norm: ClassVar[bool] = False
