"""The CPU executor (backends/cpu/executor.py): kernels chosen once, every path against the plain model.

The default production path (bf16, kernels on, the engine loading the model itself) is tested end
to end against the torch path on the real default model.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tandem.common.torch_part.model_cache import resolve_model
from tandem.common.torch_part.quantized_tensor import quantize
from tandem.decoder.backends.cpu import executor as cpu_executor
from tandem.decoder.backends.cpu import int8_tile_choice, kernel_choice
from tandem.decoder.backends.cpu import kernels as cpu_kernels
from tandem.decoder.backends.cpu.executor import CpuExecutor, choose_linears
from tandem.decoder.backends.cpu.isa import CpuInfo, runnable_levels, this_cpu
from tandem.decoder.backends.cpu.kernel_options import KernelOptions
from tandem.decoder.backends.cpu.linear import has_onednn_bf16
from tandem.decoder.config import EngineConfig
from tandem.decoder.engine.admission.prompt import GenerateSpec
from tandem.decoder.engine.front.engine import Engine
from tandem.decoder.engine.outputs.outputs import Delta
from tandem.decoder.engine.params import SamplingParams, StoppingParams
from tandem.decoder.models import quantized
from tandem.decoder.models.config import ModelConfig
from tandem.decoder.models.loader import load_model
from tandem.decoder.models.qwen3 import Qwen3ForCausalLM

from ...conftest import Checkpoint
from ...models.helpers import PagedRun, greedy, greedy_batch

PROMPT = [17, 402, 33, 981, 5, 250, 250, 731, 64, 12, 1000, 3, 88]


def test_without_a_measured_plan_linears_go_to_every_builds_c_kernel_and_to_onednn_only_without_one(
    kernels, checkpoints: dict[str, Checkpoint]
) -> None:
    # The C kernels keep a row's sums in one order at any row count, oneDNN's and MKL's do not: every
    # build's, bf16 (packed for VDPBF16PS, or read in place) and float32 alike.
    bf16 = load_model(checkpoints["qwen3"].path, dtype="bfloat16").model
    assert choose_linears(bf16, kernels) == "c"
    assert choose_linears(bf16, None) == ("onednn" if has_onednn_bf16() else "torch")
    fp32 = load_model(checkpoints["qwen3"].path, dtype="float32").model
    assert choose_linears(fp32, kernels) == "c"  # csrc/linear_f32.c
    assert choose_linears(fp32, None) == "torch"


@pytest.mark.parametrize("linears", ["c", "onednn", "torch"])
def test_every_path_gives_the_plain_models_greedy_tokens(
    kernels, checkpoint: Checkpoint, linears: str
) -> None:
    if linears == "onednn" and not has_onednn_bf16():
        pytest.skip("oneDNN has no bf16 path on this CPU (AVX2 only): no packed linears to test")
    model = load_model(checkpoint.path, dtype="bfloat16").model
    want = greedy(model, PROMPT, 12)
    executor = CpuExecutor(model, kernels, linears=linears)  # type: ignore[arg-type]
    assert executor.choice.linears == linears
    # Only the C kernel keeps a row's sums in one order at any row count (--batch-invariant verifies
    # proposals row by row otherwise).
    assert executor.rows_exact == (linears == "c")
    assert greedy_with(executor, model, PROMPT, 12) == want


def test_float32_linears_are_the_c_kernels_so_rows_are_exact_where_a_build_is_loaded(
    kernels, checkpoint: Checkpoint
) -> None:
    model = load_model(checkpoint.path, dtype="float32").model
    executor = CpuExecutor(model, kernels)
    assert executor.choice.linears == "c" and executor.rows_exact
    assert greedy_with(executor, model, PROMPT, 12) == greedy(model, PROMPT, 12)
    without = CpuExecutor(model, None)  # no build: torch's linears, --batch-invariant verifies row by row
    assert without.choice.linears == "torch" and not without.rows_exact


@pytest.fixture
def without_avx512_bf16(monkeypatch: pytest.MonkeyPatch) -> CpuInfo:
    """This CPU's flags less avx512_bf16 and AMX, as every kernel choice reads them: an AVX-512 server
    CPU before Cooper Lake (Skylake-SP, Cascade Lake, Ice Lake), whose highest build, avx512, reads
    bf16 weights in place and whose oneDNN has a bf16 path."""
    cpu = this_cpu()
    emulated = replace(cpu, flags=frozenset(f for f in cpu.flags if f != "avx512_bf16" and "amx" not in f))
    if runnable_levels(emulated)[-1].name != "avx512" or not has_onednn_bf16():
        pytest.skip("emulates an AVX-512 CPU without AVX512-BF16: needs one with AVX-512 and oneDNN's bf16")
    for module in (kernel_choice, int8_tile_choice, cpu_kernels, cpu_executor):
        monkeypatch.setattr(module, "this_cpu", lambda: emulated)
    return emulated


def test_without_avx512_bf16_and_no_measured_plan_a_verification_gives_plain_decodings_bits(
    without_avx512_bf16: CpuInfo, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No plan is measured for a small model (nor for several ranks or quantized weights): the flags'
    # choice must still keep decode and verify rows on an exact kernel. oneDNN's bf16 linear gave a
    # verification's rows other bits than one-row steps (its blocking follows the row count), so
    # speculation changed the logprobs of plain decoding in the default mode.
    config = ModelConfig(
        architecture="Qwen3ForCausalLM", vocab_size=1024, hidden_size=576, intermediate_size=1536,
        num_layers=2, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-6, rope_theta=10000.0,
        rope_scaling=None, tie_word_embeddings=False, max_position_embeddings=512, eos_token_ids=(1,),
        dtype=torch.bfloat16,
    )  # fmt: skip
    torch.manual_seed(1)
    model = Qwen3ForCausalLM(config).to(torch.bfloat16).train(False)
    monkeypatch.setattr(kernel_choice, "MIN_MEASURED_BYTES", 1 << 62)  # never measured: no plan
    executor = cpu_executor.bind(model, KernelOptions(exact_rows=8, max_rows=256))
    assert executor.choice.build == "avx512" and executor.rows_exact
    verified, plain = PagedRun(model, step=executor), PagedRun(model, step=executor)
    for run in (verified, plain):
        run.step([("s", PROMPT)])
    # A verification's rows, as many as a step without prompt rows holds: the last token and 7 proposed.
    proposal = [5, 60, 7, 31, 88, 2, 40, 13]
    got = verified.step([("s", proposal)], all_logits=True)  # [8, vocab]
    want = torch.cat([plain.step([("s", [token])]) for token in proposal])
    assert torch.equal(got, want)


def greedy_with(executor: CpuExecutor, model, prompt: list[int], max_new_tokens: int) -> list[int]:
    run = PagedRun(model, step=executor)
    tokens = [int(run.step([("s", prompt)])[0].argmax())]
    while len(tokens) < max_new_tokens:
        tokens.append(int(run.step([("s", tokens[-1:])])[0].argmax()))
    return tokens


def test_without_a_build_the_executor_runs_torch_ops_and_says_so(checkpoints: dict[str, Checkpoint]) -> None:
    model = load_model(checkpoints["qwen3"].path, dtype="bfloat16").model
    executor = CpuExecutor(model, None)
    assert executor.choice.build is None and not executor.choice.c_ops and executor.fused is None
    assert "no C kernels" in executor.choice.describe()
    assert greedy_with(executor, model, PROMPT, 8) == greedy(model, PROMPT, 8)


def engine_tokens(config: EngineConfig, prompt: list[int], max_new_tokens: int) -> list[int]:
    spec = GenerateSpec(
        [prompt],
        SamplingParams(temperature=0.0),
        StoppingParams(max_new_tokens=max_new_tokens, ignore_eos=True),
    )
    with Engine(config) as engine:
        return [t for e in engine.generate(spec) if isinstance(e, Delta) for t in e.token_ids]


def test_the_default_production_path_gives_the_torch_paths_greedy_tokens_on_the_default_model() -> None:
    # bf16, kernels on, the engine loading the model itself: what `tandem up` runs. Against the plain
    # model on torch ops (--native-kernels false). The kernels sum in another order than torch (and
    # attention does not round between its matmuls), so bf16 logits may differ in their last bits:
    # the stated bound is the first 16 greedy tokens of a real prompt.
    model_dir = resolve_model(None)
    prompt = load_model(model_dir, dtype="bfloat16").tokenizer.encode("The capital of France is").ids
    config = EngineConfig(model_dir=model_dir, dtype="bfloat16", num_kv_blocks=64)
    on_kernels = engine_tokens(config, prompt, 16)
    on_torch = engine_tokens(EngineConfig(model_dir=model_dir, dtype="bfloat16", num_kv_blocks=64,
                                          native_kernels=False), prompt, 16)  # fmt: skip
    assert len(on_kernels) == 16
    assert on_kernels == on_torch


def test_a_model_past_the_c_kernels_limits_runs_per_op_on_torch_and_matches_the_plain_model(
    kernels,
) -> None:
    # head_dim past the C kernels' scratch (limits.max_head_dim): nothing may fuse or call the C ops,
    # even where the C linears are chosen, and the executor still gives the model's logits.
    config = ModelConfig(
        architecture="Qwen3ForCausalLM", vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=kernels.limits.max_head_dim + 16, rms_norm_eps=1e-6,
        rope_theta=10000.0, rope_scaling=None, tie_word_embeddings=False, max_position_embeddings=512,
        eos_token_ids=(1,), dtype=torch.bfloat16,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to(torch.bfloat16).train(False)
    executor = CpuExecutor(model, kernels, linears="c")
    assert executor.fused is None and executor.stack is None and not executor.choice.c_ops
    steps = [[("a", [3, 4, 5, 6]), ("b", [7, 8])], [("a", [9]), ("b", [10])]]
    plain, on_executor = PagedRun(model), PagedRun(model, step=executor)
    for chunks in steps:
        want, got = plain.step(chunks), on_executor.step(chunks)
        assert (got - want).abs().max() <= 0.02 * want.abs().max()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_quantized_weights_run_on_the_quantized_kernels_with_the_models_own_tokens(
    kernels, checkpoints: dict[str, Checkpoint], bits: int, dtype: str
) -> None:
    # Every linear and the token table rounded to `bits`: the executor binds kernels that read the codes
    # in place (fused layers and the one-call stack on AVX512-BF16 builds, as for bf16 weights).
    model = load_model(checkpoints["qwen3"].path, dtype=dtype).model
    dense = {name: p for name, p in model.named_parameters() if p.dim() == 2}
    quantized.apply(model, {name: quantize(p, bits) for name, p in dense.items()})
    executor = CpuExecutor(model, kernels)
    assert (
        executor.choice.quantized == f"{bits}-bit"
        and f"quantized ({bits}-bit) ones" in executor.choice.describe()
    )
    if dtype == "bfloat16" and kernels.weight_layout != 0:
        assert executor.fused is not None and executor.stack is not None
    # A request's tokens do not depend on its neighbours: prefilled and decoded together (quantized
    # tiles of several rows) or alone (one row), the same tokens.
    prompts = [PROMPT, PROMPT[3:9], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]]
    alone = [greedy(model, p, 8, step=executor) for p in prompts]
    assert greedy_batch(model, prompts, 8, step=executor) == alone
    if dtype == "float32":
        # The reference dequantizes the same values; only the order of fp32 sums differs.
        assert greedy_with(executor, model, PROMPT, 12) == greedy(model, PROMPT, 12)
    else:
        # Close to bf16 weights holding the dequantized values (which round each weight to bf16; the
        # kernels multiply the exact values).
        same = load_model(checkpoints["qwen3"].path, dtype=dtype).model
        for name, p in same.named_parameters():
            if name in dense:
                module = model.get_submodule(name.removesuffix(".weight"))
                p.copy_(module.qweight.dequantize(torch.bfloat16))
        got = PagedRun(model, step=executor).step([("s", PROMPT)])
        want = PagedRun(same, step=CpuExecutor(same, kernels)).step([("s", PROMPT)])
        assert (got - want).abs().max() < 0.05 * want.abs().max()
        if kernels.weight_layout != 0:
            # From dense_rows rows on (prefill steps, in an engine), the quantized model computes what
            # the dense one computes, bit for bit: each weight rounded to bf16 into the packed kernel.
            dense_from = CpuExecutor(model, kernels, dense_rows=len(PROMPT))
            assert f"steps of {len(PROMPT)}+ rows" in dense_from.choice.describe()
            got = PagedRun(model, step=dense_from).step([("s", PROMPT)], all_logits=True)
            want = PagedRun(same, step=CpuExecutor(same, kernels)).step([("s", PROMPT)], all_logits=True)
            assert torch.equal(got, want)


def test_layers_bound_op_by_op_read_quantized_weights_as_the_fused_ones_do(
    kernels, checkpoints: dict[str, Checkpoint], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Several ranks (or a layer the fused halves cannot take) bind each projection on its own: from
    # dense_rows rows on a bf16 call still reads each quantized weight as its bf16 rounding, so a
    # prompt's logits are the dense model's bit for bit, as with fused layers.
    if kernels.weight_layout == 0:
        pytest.skip("only the packed bf16 kernel's builds have the dense path")
    monkeypatch.setattr("tandem.decoder.backends.cpu.executor._fuse", lambda *args: None)
    model = load_model(checkpoints["qwen3"].path, dtype="bfloat16").model
    same = load_model(checkpoints["qwen3"].path, dtype="bfloat16").model
    dense = {name: p for name, p in model.named_parameters() if p.dim() == 2}
    quantized.apply(model, {name: quantize(p, 4) for name, p in dense.items()})
    for name, p in same.named_parameters():
        if name in dense:
            p.copy_(model.get_submodule(name.removesuffix(".weight")).qweight.dequantize(torch.bfloat16))
    per_op = CpuExecutor(model, kernels, dense_rows=len(PROMPT))
    assert per_op.fused is None
    got = PagedRun(model, step=per_op).step([("s", PROMPT)], all_logits=True)
    want = PagedRun(same, step=CpuExecutor(same, kernels)).step([("s", PROMPT)], all_logits=True)
    assert torch.equal(got, want)
