"""Quantized weights on several ranks (models/quantized_shards.py): each rank holds the one-rank
quantized model's codes, scales and offsets for its part of every projection and of the token table,
value for value, so two gloo ranks give the one-rank quantized engine's greedy tokens, with logits
and logprobs equal up to the order in which the all-reduce sums the row-parallel partial sums
(float32: 1e-5 relative), for int8, int4, a GGUF file's own Q4_0 blocks, 8-bit activations and LoRA
adapters; a model whose row-parallel inputs do not split into whole blocks of 32 is refused, naming
the projection and the limit."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer
from transformers import LlamaConfig, LlamaForCausalLM

from common.tests.common.gguf_files import mixed_types, small_model, write_gguf
from services.decoder.tests.lora_adapters import SPECS, make_adapter
from services.decoder.tests.models.helpers import save_hf_checkpoint
from tandem.common.torch_part.gguf_import import import_gguf
from tandem.common.torch_part.quantized_tensor import BLOCK, QuantizedTensor
from tandem.decoder.engine.front.engine import Engine
from tandem.decoder.models.loader import ModelLoadError, load_model
from tandem.decoder.models.quantized import QuantizedEmbedding, QuantizedLinear
from tandem.decoder.models.tensor_parallel import checkpoint_parts
from tandem.decoder.models.transformer import DecoderModel

from . import scenarios
from .harness import FakeRank, run_ranks

Q = gguf.GGMLQuantizationType
PROMPT = [17, 402, 33, 981, 5, 250, 250, 731, 64, 12, 17, 402, 33]  # 13 tokens: odd, padded under SP
NUM_TOKENS = 12


@pytest.fixture(scope="module")
def gguf_model(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A small Llama written as a GGUF file of Q4_0 blocks (its Q and K rows in llama.cpp's order, which
    the reader puts back before any cut), and the directory imported from it: (directory, file)."""
    root = tmp_path_factory.mktemp("gguf-ranks")
    tokenizer = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    path = write_gguf(root / "m.gguf", small_model("llama", tokenizer.get_vocab_size()), tokenizer, Q.Q4_0)
    return import_gguf(path, root / "imported", dtype="float32"), path


@pytest.fixture(scope="module")
def mixed_gguf_model(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The same Llama as gguf_model's, each fused projection of tensors in different types (q and k
    Q4_0 beside a Q8_0 v: 8 bits; a Q4_1 gate beside a Q4_0 up: offsets; a Q4_1 q beside Q8_0 k and v:
    rounded to 8 bits), F16 down_proj and F32 o_proj tensors (8 bits) and a Q8_0 table."""
    root = tmp_path_factory.mktemp("gguf-mixed-ranks")
    tokenizer = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    hf_model = small_model("llama", tokenizer.get_vocab_size())
    layer = "model.layers.{}.{}.weight"
    types = {
        layer.format(0, "self_attn.v_proj"): Q.Q8_0,
        layer.format(0, "mlp.gate_proj"): Q.Q4_1,
        layer.format(1, "self_attn.q_proj"): Q.Q4_1,
        layer.format(1, "self_attn.k_proj"): Q.Q8_0,
        layer.format(1, "self_attn.v_proj"): Q.Q8_0,
        layer.format(0, "mlp.down_proj"): Q.F16,
        layer.format(1, "self_attn.o_proj"): Q.F32,
        "model.embed_tokens.weight": Q.Q8_0,
    }
    raw = mixed_types(hf_model, types)
    path = write_gguf(root / "m.gguf", hf_model, tokenizer, Q.Q4_0, raw_tensors=raw)
    return import_gguf(path, root / "imported", dtype="float32"), path


def _options(quantization: str, gguf_path: Path | None = None, **more: Any) -> dict[str, Any]:
    options: dict[str, Any] = {"quantization": quantization, **more}
    if gguf_path is not None:
        options["quantized_from"] = gguf_path
    return options


def _load(model_dir: Path, options: dict[str, Any], tp: FakeRank | None = None) -> DecoderModel:
    return load_model(
        model_dir,
        dtype="float32",
        tp=tp,  # type: ignore[arg-type]
        quantization=options["quantization"],
        quantized_from=options.get("quantized_from"),
        group_size=options.get("quantization_group_size", BLOCK),
    ).model


def _expected_cut(
    one_rank: QuantizedTensor, model: DecoderModel, name: str, shape: tuple[int, ...]
) -> list[torch.Tensor]:
    """The rank's part of the one-rank weight's codes, scales and offsets ([n, k] and [n, k / 32]),
    cut by hand: each checkpoint part's rows (fused q, k, v or gate, up) in turn, its rows or its
    input columns (whole blocks) the rank's. `shape`: the rank's weight's."""
    tp = model.tp
    assert tp is not None
    unpacked = [t for t in one_rank.unpack() if t is not None]
    cuts: list[list[torch.Tensor]] = [[] for _ in unpacked]
    start = 0
    for part in checkpoint_parts(model.config, name, shape, tp.world_size):
        rows = slice(start, start + part.shape[0])
        start += part.shape[0]
        for i, tensor in enumerate(unpacked):
            piece = tensor[rows]
            if part.shard_dim is not None:
                share = piece.shape[part.shard_dim] // tp.world_size
                piece = piece.narrow(part.shard_dim, tp.rank * share, share)
            cuts[i].append(piece)
    assert start == one_rank.n
    return [torch.cat(pieces) for pieces in cuts]


CASES = {
    "int8": {"quantization": "int8"},
    "int4": {"quantization": "int4", "quantization_group_size": 64},  # a group spans a rank's 32 inputs
}


@pytest.mark.parametrize("case", [*CASES, "gguf"])
def test_each_rank_holds_the_one_rank_quantized_weights_cut_as_the_dense_ones(
    case: str, tiny_model_dir: Path, gguf_model: tuple[Path, Path]
) -> None:
    if case == "gguf":
        model_dir, options = gguf_model[0], _options("gguf", gguf_model[1])
    else:
        model_dir, options = tiny_model_dir, CASES[case]
    one_rank = _load(model_dir, options)
    names = [n for n, m in one_rank.named_modules() if isinstance(m, QuantizedLinear | QuantizedEmbedding)]
    assert sum("o_proj" in n for n in names) == one_rank.config.num_layers and "embed_tokens" in names
    for rank in range(2):
        model = _load(model_dir, options, FakeRank(rank, 2))
        for name in names:
            module = model.get_submodule(name)
            assert isinstance(module, QuantizedLinear | QuantizedEmbedding), name
            one = one_rank.get_submodule(name).qweight
            want = _expected_cut(one, model, f"{name}.weight", module.qweight.shape)
            got = [t for t in module.qweight.unpack() if t is not None]
            assert len(got) == len(want), name
            for got_tensor, want_tensor in zip(got, want, strict=True):
                assert torch.equal(got_tensor, want_tensor), f"rank {rank}: {name}"
        assert not any(p.dim() == 2 for p in model.parameters())  # no dense linear weight is left


def _assert_same_outputs(got: list, want: list) -> None:
    for (tokens, logprobs, top, prompt), (ref_tokens, ref_logprobs, ref_top, ref_prompt) in zip(
        got, want, strict=True
    ):
        assert tokens == ref_tokens
        assert len(prompt) == len(ref_prompt) > 0
        for values, reference in ((prompt, ref_prompt), (logprobs, ref_logprobs), (top, ref_top)):
            torch.testing.assert_close(torch.tensor(values), torch.tensor(reference), rtol=1e-5, atol=1e-5)


ENGINE_CASES = ("int8", "int4", "gguf", "gguf-int8-activations", "gguf-mixed-types")


@pytest.fixture(scope="module")
def engine_runs(
    tiny_model_dir: Path, gguf_model: tuple[Path, Path], mixed_gguf_model: tuple[Path, Path]
) -> dict[str, tuple[Path, dict[str, Any]]]:
    """case -> the checkpoint and engine options it serves."""
    gguf_dir, gguf_path = gguf_model
    runs = {case: (tiny_model_dir, CASES[case]) for case in CASES}
    runs["gguf"] = gguf_dir, _options("gguf", gguf_path)
    runs["gguf-int8-activations"] = gguf_dir, _options("gguf", gguf_path, quantized_activations="int8")
    runs["gguf-mixed-types"] = mixed_gguf_model[0], _options("gguf", mixed_gguf_model[1])
    assert tuple(runs) == ENGINE_CASES
    return runs


@pytest.fixture(scope="module")
def two_rank_outputs(engine_runs: dict[str, tuple[Path, dict[str, Any]]]) -> dict[str, tuple[Any, Any]]:
    """Each case's engine on two ranks, one case after another in one group (spawning the ranks costs
    more than a tiny model's engine). case -> (rank 0's outputs, rank 1's result)."""
    rank0, rank1 = run_ranks(
        scenarios.rank_engine_outputs_each, 2, list(engine_runs.values()), timeout_s=120 * len(engine_runs)
    )
    return {case: (rank0[i], rank1[i]) for i, case in enumerate(engine_runs)}


@pytest.mark.parametrize("case", ENGINE_CASES, ids=lambda case: case.replace("-", " "))
def test_two_quantized_ranks_generate_what_the_one_rank_quantized_engine_does(
    case: str,
    engine_runs: dict[str, tuple[Path, dict[str, Any]]],
    two_rank_outputs: dict[str, tuple[Any, Any]],
) -> None:
    engine = Engine(scenarios.engine_config(*engine_runs[case])).start()
    try:
        reference = scenarios.engine_outputs(engine)
    finally:
        engine.shutdown()
    rank0, rank1 = two_rank_outputs[case]
    assert rank1 is None  # the worker ran until rank 0's STOP
    _assert_same_outputs(rank0, reference)


def test_lora_adapters_on_quantized_ranks_give_the_one_rank_quantized_tokens(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    specs = [
        ("qv4", SPECS["qv4"]),
        ("mlp8", SPECS["mlp8"]),
        ("all16", SPECS["all16"]),
        ("qv4b", SPECS["qv4"]),
    ]
    adapters = {
        name: make_adapter(tiny_model_dir, tmp_path / name, spec, seed=i)
        for i, (name, spec) in enumerate(specs)
    }
    options = CASES["int8"]
    want = scenarios.rank_lora_tokens(None, tiny_model_dir, adapters, PROMPT, NUM_TOKENS, options)
    first, second, _ = want
    assert len({tuple(tokens) for tokens in first.values()}) == 4  # every adapter changes the answer
    rank0, rank1 = run_ranks(
        scenarios.rank_lora_tokens, 2, tiny_model_dir, adapters, PROMPT, NUM_TOKENS, options, timeout_s=180
    )
    assert rank1 is None
    assert rank0 == want


@pytest.fixture(scope="module")
def three_rank_model(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama 2 with biases on every projection and an untied head, sized for three ranks: 342 rows of
    its 1026-row vocabulary a rank (not whole groups of 16 outputs: each rank's cut is padded), 2 of its
    6 heads and 1 of its 3 KV heads, 64 of o_proj's 192 inputs and 128 of down_proj's 384."""
    config = LlamaConfig(
        vocab_size=1026,
        hidden_size=192,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=3,
        head_dim=32,
        attention_bias=True,
        mlp_bias=True,
        tie_word_embeddings=False,
        initializer_range=0.1,  # logits far apart: no near-ties for greedy
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).train(False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):  # transformers starts them at 0
                p.normal_(std=0.1)
    out = tmp_path_factory.mktemp("three-ranks")
    return save_hf_checkpoint(model, out, tiny_model_dir / "tokenizer.json")


def test_three_quantized_ranks_with_biases_and_groups_across_ranks_generate_the_one_rank_tokens(
    three_rank_model: Path,
) -> None:
    """int4 groups of 192 inputs: one group is o_proj's whole row, held by three ranks, and down_proj's
    groups straddle ranks; the biases of o_proj and down_proj are added once, after the sum."""
    options = {"quantization": "int4", "quantization_group_size": 192}
    engine = Engine(scenarios.engine_config(three_rank_model, options)).start()
    try:
        reference = scenarios.engine_outputs(engine)
    finally:
        engine.shutdown()
    outputs = run_ranks(scenarios.rank_engine_outputs, 3, three_rank_model, options, timeout_s=120)
    assert outputs[1:] == [None, None]
    _assert_same_outputs(outputs[0], reference)


def _narrow_mlp(source: Path, out: Path, intermediate_size: int) -> Path:
    """A copy of `source` whose MLPs keep their first `intermediate_size` channels."""
    shutil.copytree(source, out)
    config = json.loads((out / "config.json").read_text())
    config["intermediate_size"] = intermediate_size
    (out / "config.json").write_text(json.dumps(config))
    weights = load_file(out / "model.safetensors")
    for name, tensor in weights.items():
        if name.endswith(("gate_proj.weight", "up_proj.weight")):
            weights[name] = tensor[:intermediate_size].contiguous()
        elif name.endswith("down_proj.weight"):
            weights[name] = tensor[:, :intermediate_size].contiguous()
    save_file(weights, out / "model.safetensors", {"format": "pt"})
    return out


def test_a_row_parallel_share_that_is_not_whole_blocks_is_refused_naming_the_projection(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """160 channels are 5 blocks of 32: one rank rounds them, two would hold 80 inputs of down_proj each."""
    model_dir = _narrow_mlp(tiny_model_dir, tmp_path / "narrow", 160)
    _load(model_dir, CASES["int8"])  # one rank: whole blocks
    load_model(model_dir, dtype="float32", tp=FakeRank(0, 2))  # type: ignore[arg-type]  # dense: cut anywhere
    said = (
        r"down_proj \(intermediate_size\) takes 160 inputs, 80 per rank over 2 ranks: quantized weights "
        r"are cut on whole blocks of 32 inputs, so each rank's share must be a multiple of 32"
    )
    with pytest.raises(ModelLoadError, match=said):
        _load(model_dir, CASES["int8"], FakeRank(0, 2))
