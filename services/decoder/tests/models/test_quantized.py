"""The quantized modules (models/quantized.py): what quantizes in a model, rounding a model's weights,
the group sizes a model's widths admit, and the modules that replace its linears and token table."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.tests.common.test_quantized_tensor import q4
from tandem.common.torch_part.quantized_tensor import pack, quantize_scheme, quantize_table
from tandem.decoder.models import quantized
from tandem.decoder.models.loader import ModelLoadError, load_model
from tandem.decoder.models.quantized import QuantizedEmbedding, QuantizedLinear


def test_the_modules_compute_with_the_dequantized_values() -> None:
    weight = pack(*q4(24, 64))
    bias = torch.randn(24)
    linear = QuantizedLinear(weight, bias)
    x = torch.randn(3, 64)
    dense = weight.dequantize(torch.float32)
    torch.testing.assert_close(linear(x), x @ dense.T + bias)
    torch.testing.assert_close(linear(x, with_bias=False), x @ dense.T)
    embedding = QuantizedEmbedding(weight, torch.bfloat16)
    ids = torch.tensor([[3, 23], [0, 3]])
    assert torch.equal(embedding(ids), dense[ids].to(torch.bfloat16))


def test_every_linear_and_the_token_table_quantize(tiny_fp32) -> None:
    names = quantized.quantizable(tiny_fp32.model)
    layers = tiny_fp32.config.num_layers
    per_layer = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
    # Tied: the LM head multiplies the token table, so the table is the head's one weight.
    assert sorted(names) == sorted(
        ["embed_tokens.weight"] + [f"layers.{i}.{m}.weight" for i in range(layers) for m in per_layer]
    )


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_loading_with_int8_or_int4_rounds_each_weight_from_its_dense_values_the_table_to_8_bits(
    tiny_model_dir: Path, tiny_fp32, scheme: str
) -> None:
    model = load_model(tiny_model_dir, dtype="float32", quantization=scheme, group_size=64).model
    for name in quantized.quantizable(tiny_fp32.model):
        module = model.get_submodule(name.removesuffix(".weight"))
        assert isinstance(module, QuantizedEmbedding if "embed" in name else QuantizedLinear), name
        dense = tiny_fp32.model.get_parameter(name)
        want = quantize_table(dense) if "embed" in name else quantize_scheme(dense, scheme, 64)
        assert torch.equal(module.qweight.codes, want.codes) and torch.equal(
            module.qweight.scales, want.scales
        )
    assert model.head_weight is model.embed_tokens.qweight  # tied: the values the lookup returns
    assert not any(p.dim() == 2 for p in model.parameters())  # no dense linear weight is left


def test_a_group_size_that_does_not_divide_every_row_is_refused_naming_the_width(
    tiny_model_dir: Path, tiny_fp32
) -> None:
    quantized.check_group(tiny_fp32.config, 64)
    with pytest.raises(
        ValueError, match=r"64, the input width of qkv_proj.*\(hidden_size\), is not a multiple of 128"
    ):
        quantized.check_group(tiny_fp32.config, 128)
    with pytest.raises(ModelLoadError, match="--quantization-group-size 128: a row of 64 inputs"):
        load_model(tiny_model_dir, dtype="float32", quantization="int4", group_size=128)
    with pytest.raises(ModelLoadError, match="gguf needs the GGUF file"):
        load_model(tiny_model_dir, dtype="float32", quantization="gguf")
