"""A checkpoint quantized for another loader: config.json's quantization_config, refused by both services.

quantization_config names the loader the weights were written for (transformers' quant_method: "fp8",
"compressed-tensors", "gptq", "awq", "bitsandbytes", ...), which Tandem has none of. Its weights are
that method's data, stored as integers or 8-bit floats beside scales (refused from the headers by
weight_shapes.type_refusal, which names a tensor, not the method), or as floats that loader changes
while loading (a bitsandbytes config quantizes float weights as they load): read as plain weights,
those would serve, without a word, another model than the config describes. So the config alone
refuses it, naming the method, before any weight is looked at. The decoder and the encoder say the
same of the checkpoint and each its own of what serves instead, in the terms of its own flags.
"""

from __future__ import annotations

from collections.abc import Mapping

# How much of a quant_method a refusal quotes: the value is the file's, of any length.
MAX_SHOWN_METHOD = 64


def quantization_refusal(hf_config: Mapping[str, object], instead: str) -> str | None:
    """The refusal of a checkpoint whose config.json (`hf_config`, or its text_config) has a
    quantization_config, ending with `instead` (what the calling service serves in its place); None
    when it has none (or null)."""
    for where, config in (("", hf_config), ("text_config.", hf_config.get("text_config"))):
        if not isinstance(config, Mapping) or config.get("quantization_config") is None:
            continue
        quantization = config["quantization_config"]
        method = quantization.get("quant_method") if isinstance(quantization, Mapping) else None
        said = (
            f"{where}quantization_config.quant_method is {_shown(method)}"
            if method is not None
            else f"{where}quantization_config is present, naming no quant_method"
        )
        reason = "the weights are stored for that quantization's own loader, which Tandem has not"
        return f"{said}: {reason}. {instead}"
    return None


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= MAX_SHOWN_METHOD else text[:MAX_SHOWN_METHOD] + "..."
