"""A GGUF file's own quantized weights (`--quantization gguf`): small Llama and Qwen3 files written here
in each served type, loaded quantized, against transformers reading the same file."""

from __future__ import annotations

import logging
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

from common.tests.common.gguf_files import mixed_types, small_model, write_gguf
from tandem.common.torch_part.gguf_import import import_gguf, readable_types
from tandem.common.torch_part.quantized_tensor import quantize
from tandem.decoder.backends.cpu.executor import CpuExecutor
from tandem.decoder.backends.cpu.kernels import load_for_cpu
from tandem.decoder.models import gguf_weights
from tandem.decoder.models.loader import ModelLoadError, load_model
from tandem.decoder.models.quantized import QuantizedEmbedding, QuantizedLinear
from tandem.decoder.models.tensor_parallel import checkpoint_parts

from .helpers import greedy

Q = gguf.GGMLQuantizationType
PROMPT = [3, 44, 210, 7]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))


def _quantized_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantizedLinear | QuantizedEmbedding)}


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0], ids=lambda q: q.name)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_served_types_keep_the_files_values_and_give_transformers_greedy_tokens(
    arch: str, qtype: Q, tokenizer: Tokenizer, tmp_path: Path
) -> None:
    path = write_gguf(tmp_path / "m.gguf", small_model(arch, tokenizer.get_vocab_size()), tokenizer, qtype)
    imported = import_gguf(path, tmp_path / "out", dtype="float32")
    loaded = load_model(imported, dtype="float32", quantization="gguf", quantized_from=path)
    model = loaded.model
    # Every linear and the token table quantized, nothing dense left of them.
    quantized = _quantized_modules(model)
    assert "embed_tokens" in quantized and all(
        isinstance(layer.mlp.down_proj, QuantizedLinear) for layer in model.layers
    )
    assert not [n for n, p in model.named_parameters() if p.dim() == 2]
    # The values are the file's: d q + m in fp32 is exactly what transformers' reader dequantizes.
    dense = load_file(imported / "model.safetensors")
    for name, module in quantized.items():
        parts = [p.name for p in checkpoint_parts(model.config, f"{name}.weight", module.qweight.shape, 1)]
        expected = torch.cat([dense[p] for p in parts])
        assert torch.equal(module.qweight.dequantize(torch.float32), expected), name

    theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="m.gguf", dtype=torch.float32)
    reference = theirs.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=8, min_new_tokens=8)
    want = reference[0, len(PROMPT) :].tolist()
    assert greedy(model, PROMPT, 8) == want  # the model's own forward
    executor = CpuExecutor(model, load_for_cpu())  # the quantized kernels, never dequantizing
    assert executor.choice.linears == "c" and not executor.fused  # float32: layer by layer
    assert greedy(model, PROMPT, 8, step=executor) == want


def test_other_types_are_re_quantized_once_and_the_log_says_so(
    tokenizer: Tokenizer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = write_gguf(tmp_path / "m.gguf", small_model("llama", tokenizer.get_vocab_size()), tokenizer, Q.F16)
    imported = import_gguf(path, tmp_path / "out", dtype="float32")
    with caplog.at_level(logging.INFO, logger="tandem.decoder.models.gguf_weights"):
        model = load_model(imported, dtype="float32", quantization="gguf", quantized_from=path).model
    assert "re-quantized once" in caplog.text and "F16" in caplog.text
    dense = load_file(imported / "model.safetensors")
    q_proj = model.layers[0].self_attn.qkv_proj.qweight
    assert q_proj.bits == 8
    got = q_proj.dequantize(torch.float32)[: dense["model.layers.0.self_attn.q_proj.weight"].shape[0]]
    want = dense["model.layers.0.self_attn.q_proj.weight"]
    assert (got - want).abs().max() <= want.abs().max() / 127  # half a step of the row's largest scale


def test_tensors_of_different_types_fused_into_one_projection_keep_the_files_values(
    tokenizer: Tokenizer, tmp_path: Path
) -> None:
    """q, k, v (gate, up) fuse into one weight of one form: a Q4_0 tensor beside Q8_0 ones takes 8-bit
    codes q - 8, beside Q4_1 ones offsets -8 d, both exact (a Q4_K_M file keeps attn_v in Q6_K beside
    Q4_K q and k). The load said "weights fused into one must share their quantization", after listening."""
    hf_model = small_model("llama", tokenizer.get_vocab_size())
    layer = "model.layers.{}.{}.weight"
    types = {
        layer.format(0, "self_attn.v_proj"): Q.Q8_0,  # beside Q4_0 q and k: 8 bits
        layer.format(0, "mlp.gate_proj"): Q.Q4_1,  # beside a Q4_0 up: offsets
        layer.format(1, "self_attn.k_proj"): Q.Q4_1,
    }
    raw = mixed_types(hf_model, types)
    path = write_gguf(tmp_path / "m.gguf", hf_model, tokenizer, Q.Q4_0, raw_tensors=raw)
    imported = import_gguf(path, tmp_path / "out", dtype="float32")
    model = load_model(imported, dtype="float32", quantization="gguf", quantized_from=path).model
    fused = (
        model.layers[0].self_attn.qkv_proj.qweight,
        model.layers[0].mlp.gate_up_proj.qweight,
        model.layers[1].self_attn.qkv_proj.qweight,
    )
    forms = [(w.bits, w.mins is not None) for w in fused]
    assert forms == [(8, False), (4, True), (4, True)]
    dense = load_file(imported / "model.safetensors")
    for name, module in _quantized_modules(model).items():
        parts = [p.name for p in checkpoint_parts(model.config, f"{name}.weight", module.qweight.shape, 1)]
        expected = torch.cat([dense[p] for p in parts])
        assert torch.equal(module.qweight.dequantize(torch.float32), expected), name
    theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="m.gguf", dtype=torch.float32)
    reference = theirs.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=8, min_new_tokens=8)
    assert (
        greedy(model, PROMPT, 8, step=CpuExecutor(model, load_for_cpu()))
        == reference[0, len(PROMPT) :].tolist()
    )


@pytest.mark.parametrize("q_type", [Q.Q4_1, Q.Q5_0], ids=["Q4_1", "a type re-quantized to 4 bits"])
def test_a_4_bit_tensor_with_offsets_beside_8_bit_ones_is_rounded_once_to_8_bits(
    q_type: Q, tokenizer: Tokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """8 bits have no offset: a Q4_1 q beside a Q8_0 v is its file's values rounded to 8 bits per block
    of 32, and so is a type re-quantized to 4 bits alone (Q4_K beside Q6_K; here Q5_0, taken for one),
    rounded once from the file's values, not from its 4-bit rounding."""
    monkeypatch.setattr(gguf_weights, "_TO_4_BITS", (*gguf_weights._TO_4_BITS, "Q5_0"))
    hf_model = small_model("llama", tokenizer.get_vocab_size())
    q_name, v_name = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.v_proj.weight"
    raw = mixed_types(hf_model, {q_name: q_type, v_name: Q.Q8_0})
    path = write_gguf(tmp_path / "m.gguf", hf_model, tokenizer, Q.Q4_0, raw_tensors=raw)
    imported = import_gguf(path, tmp_path / "out", dtype="float32")
    model = load_model(imported, dtype="float32", quantization="gguf", quantized_from=path).model
    qkv = model.layers[0].self_attn.qkv_proj.qweight
    assert qkv.bits == 8
    dense = load_file(imported / "model.safetensors")  # in float32: the file's values
    num_q = dense[q_name].shape[0]
    got = qkv.dequantize(torch.float32)
    assert torch.equal(got[:num_q], quantize(dense[q_name], 8).dequantize(torch.float32))
    k_and_v = torch.cat([dense[q_name.replace("q_proj", "k_proj")], dense[v_name]])
    assert torch.equal(got[num_q:], k_and_v)  # Q4_0 k as 8-bit codes q - 8, Q8_0 v: the file's values


def test_a_file_that_does_not_match_the_checkpoint_is_one_load_error(
    tokenizer: Tokenizer, tmp_path: Path
) -> None:
    vocab = tokenizer.get_vocab_size()
    first = write_gguf(tmp_path / "a.gguf", small_model("llama", vocab), tokenizer, Q.Q8_0)
    other = write_gguf(tmp_path / "b.gguf", small_model("qwen3", vocab), tokenizer, Q.Q8_0)
    imported = import_gguf(first, tmp_path / "out", dtype="float32")
    with pytest.raises(ModelLoadError, match="has no tensor for|a quantized weight of"):
        load_model(imported, dtype="float32", quantization="gguf", quantized_from=other)


def test_a_hostile_gguf_header_is_one_load_error_naming_the_file(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The gguf reader recursed once per nested array (RecursionError, a traceback at start-up); the
    bounded header walk refuses it first."""
    key = b"x.a"
    nested = len(key).to_bytes(8, "little") + key + (9).to_bytes(4, "little")
    nested += ((9).to_bytes(4, "little") + (1).to_bytes(8, "little")) * 100_000
    path = tmp_path / "hostile.gguf"
    path.write_bytes(
        b"GGUF" + (3).to_bytes(4, "little") + (0).to_bytes(8, "little") + (1).to_bytes(8, "little") + nested
    )
    with pytest.raises(ModelLoadError, match=rf"--quantization gguf: {path} cannot be read: .*nests arrays"):
        load_model(tiny_model_dir, dtype="float32", quantization="gguf", quantized_from=path)


def test_a_type_gguf_cannot_dequantize_is_named_with_the_readable_ones(
    tokenizer: Tokenizer, tmp_path: Path
) -> None:
    """The import refuses such a file first (before the decoder listens); load_model may be given
    another file than the one imported, which says the same of it."""
    model = small_model("llama", tokenizer.get_vocab_size())
    imported = import_gguf(write_gguf(tmp_path / "a.gguf", model, tokenizer, Q.Q8_0), tmp_path / "out")
    q8_1 = np.zeros((128, 2 * 40), dtype=np.uint8)  # up_proj's 128 rows of two Q8_1 blocks of 32 values
    other = write_gguf(
        tmp_path / "b.gguf", model, tokenizer, Q.Q8_0, raw_tensors={"blk.1.ffn_up.weight": (q8_1, Q.Q8_1)}
    )
    with pytest.raises(ModelLoadError) as raised:
        load_model(imported, dtype="float32", quantization="gguf", quantized_from=other)
    assert str(raised.value) == (
        "--quantization gguf: blk.1.ffn_up.weight (model.layers.1.mlp.up_proj.weight) is of GGML type Q8_1, "
        f"which the gguf package cannot dequantize (readable: {', '.join(readable_types())})"
    )
