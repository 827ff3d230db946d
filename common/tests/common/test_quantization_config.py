"""quantization_config: a checkpoint quantized for another loader is refused from its config.json alone,
naming the method, and ending with what the calling service serves instead."""

from __future__ import annotations

import pytest

from tandem.common.quantization_config import MAX_SHOWN_METHOD, quantization_refusal

# What a service says serves in the checkpoint's place: the caller's words, passed through.
INSTEAD = "Serve what this service serves instead."
REASON = ": the weights are stored for that quantization's own loader, which Tandem has not. "


@pytest.mark.parametrize(
    "quantization",
    [
        {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
        {"quant_method": "compressed-tensors", "format": "float-quantized"},
        {"quant_method": "gptq", "bits": 4, "group_size": 128},
        {"quant_method": "awq", "bits": 4, "version": "gemm"},
        {"quant_method": "bitsandbytes", "load_in_4bit": True},
    ],
)
def test_a_quantization_config_is_refused_naming_its_method_and_what_serves_instead(
    quantization: dict[str, object],
) -> None:
    config = {"hidden_size": 576, "quantization_config": quantization}
    assert quantization_refusal(config, INSTEAD) == (
        f"quantization_config.quant_method is {quantization['quant_method']!r}{REASON}{INSTEAD}"
    )


def test_a_vision_language_configs_language_model_may_carry_the_quantization() -> None:
    config = {"text_config": {"quantization_config": {"quant_method": "awq"}}}
    assert quantization_refusal(config, INSTEAD) == (
        f"text_config.quantization_config.quant_method is 'awq'{REASON}{INSTEAD}"
    )


def test_a_quantization_config_naming_no_method_is_refused_all_the_same() -> None:
    """Older bitsandbytes configs say load_in_8bit alone; transformers takes the method from it."""
    refusal = f"quantization_config is present, naming no quant_method{REASON}{INSTEAD}"
    assert quantization_refusal({"quantization_config": {"load_in_8bit": True}}, INSTEAD) == refusal
    assert quantization_refusal({"quantization_config": "int8"}, INSTEAD) == refusal


def test_a_method_of_any_length_is_quoted_within_the_bound() -> None:
    refusal = quantization_refusal({"quantization_config": {"quant_method": "q" * 100_000}}, INSTEAD)
    assert refusal is not None
    said = refusal.removeprefix("quantization_config.quant_method is ").removesuffix(REASON + INSTEAD)
    assert said == repr("q" * 100_000)[:MAX_SHOWN_METHOD] + "..."


def test_a_config_without_a_quantization_config_or_with_null_is_not_refused() -> None:
    assert quantization_refusal({"hidden_size": 576}, INSTEAD) is None
    nulls = {"quantization_config": None, "text_config": {"quantization_config": None}}
    assert quantization_refusal(nulls, INSTEAD) is None
