"""Where a decode step goes: per-category and per-op time at N sequences, on the engine's own thread.

For each N, N requests of `--prompt-len` random tokens are admitted to a (not started) Engine and
stepped by hand on the engine thread: their prefill, a few warm decode steps, then `--steps` decode
steps measured three ways, each pass on its own so that no instrument distorts another:

1. plain: wall time per step, split into the engine's host phases (schedule, batch building,
   forward, sampling, scheduler update, events) by timing wrappers around those methods;
2. modules: forward hooks time each module kind (q/k/v, o, gate/up, down projections, RMSNorms, the
   attention core, SwiGLU's activation, the LM head), and the C kernels' ctypes calls are timed;
3. ops: torch.profiler's self time per aten op and the op count per step.

"Python and dispatch" is the forward's wall time (pass 1) minus the time spent inside aten ops
(pass 3) and inside the C kernels (pass 2): module calls, argument checks, tensor wrappers.
Hooks cost ~2-4 us per module call, so pass 2's categories add up to more than pass 1's forward.

Run: `.venv/bin/python bench/profile_step.py` (SmolLM2-135M-Instruct bf16, N = 1, 8, 32), or
`--model-dir DIR`, `--path modules` (the executor without its one-call decode stack) or `--path torch`
(the layers op by op, linears on torch: the state before the C linears and fused layers), or
`--lora K` (an engine with --enable-lora holding K adapters of rank 16 on all seven projections,
request i on adapter i % K; `--lora K --base-rows`: the same engine, every request on the base model),
or `--quantization gguf [--quantized-activations int8]` (the default model file's own quantized weights).
The prefill of the N prompts is timed too (wall time of its steps).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_throughput import StepTimer, build_engine, make_prompts  # noqa: E402
from lora_throughput import RANK, write_adapter  # noqa: E402

from tandem.common.torch_part.model_cache import default_model_file, resolve_model  # noqa: E402
from tandem.decoder.backends.cpu.build import this_machine_levels  # noqa: E402
from tandem.decoder.backends.cpu.executor import CpuExecutor  # noqa: E402
from tandem.decoder.backends.cpu.kernels import load  # noqa: E402
from tandem.decoder.backends.cpu.linear import CLinear  # noqa: E402
from tandem.decoder.engine.admission.prompt import GenerateSpec  # noqa: E402
from tandem.decoder.engine.outputs.outputs import OutputOptions, OutputState  # noqa: E402
from tandem.decoder.engine.params import SamplingParams, StoppingParams  # noqa: E402
from tandem.decoder.models import transformer  # noqa: E402
from tandem.decoder.models.layers import RMSNorm, SwiGLU  # noqa: E402
from tandem.decoder.models.linear import Linear  # noqa: E402
from tandem.decoder.models.loader import check_checkpoint  # noqa: E402

LINEAR_NAMES = {
    "qkv_proj": "q/k/v projection",
    "o_proj": "o projection",
    "gate_up_proj": "gate/up projection",
    "down_proj": "down projection",
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, default=None, help="default: SmolLM2-135M-Instruct bf16")
    p.add_argument("--sizes", default="1,8,32")
    p.add_argument("--steps", type=int, default=16, help="measured decode steps per pass")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--path", choices=("fused", "modules", "torch"), default="fused",
                   help="fused layers; op by op with C linears; op by op with torch linears")  # fmt: skip
    p.add_argument("--lora", type=int, default=0, help="adapters loaded (rank 16, all projections); 0: off")
    p.add_argument("--base-rows", action="store_true", help="with --lora: every request on the base model")
    p.add_argument("--quantization", choices=("none", "gguf"), default="none",
                   help="gguf: the default model file's own quantized weights")  # fmt: skip
    p.add_argument("--quantized-activations", choices=("none", "int8"), default="none",
                   help="with --quantization gguf: every linear's inputs rounded to int8 per 32")  # fmt: skip
    return p.parse_args()


def admit(engine, prompts: list[list[int]], new_tokens: int, adapters: list[str]) -> None:
    """What Engine.submit does, without the running loop (the caller steps the core itself); request i
    on adapters[i % len(adapters)]."""
    for i, prompt in enumerate(prompts):
        spec = GenerateSpec([prompt], SamplingParams(temperature=0.0),
                            StoppingParams(max_new_tokens=new_tokens, ignore_eos=True),
                            OutputOptions(include_text=False),
                            adapter=adapters[i % len(adapters)])  # fmt: skip
        request = engine.make_request(spec)
        output = OutputState(request.request_id, request.prompt_token_ids, request.is_token_ids,
                             request.stopping, spec.output, engine.tokenizer, engine.eos_token_ids,
                             engine.max_model_len, request.arrival_time)  # fmt: skip
        engine.core.add(request, output, lambda event: None, None)


class ModuleClock:
    """Forward hooks that add each module call's wall time to its category."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.ms: dict[str, float] = defaultdict(float)
        self._starts: dict[int, float] = {}
        self._handles = []
        for name, module in model.named_modules():
            category = self._category(name, module)
            if category is not None:
                self._handles.append(module.register_forward_pre_hook(self._pre))
                self._handles.append(module.register_forward_hook(self._post(category)))

    @staticmethod
    def _category(name: str, module: torch.nn.Module) -> str | None:
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, Linear):
            return LINEAR_NAMES.get(leaf, leaf)
        if isinstance(module, RMSNorm):
            return "RMSNorm (q/k, per head)" if leaf in ("q_norm", "k_norm") else "RMSNorm"
        if isinstance(module, (transformer.Attention, SwiGLU, transformer.DecoderLayer)):
            return type(module).__name__ + " (total)"
        if isinstance(module, transformer.DecoderModel):
            return "forward (total)"
        return None

    def _pre(self, module: torch.nn.Module, args: object) -> None:
        self._starts[id(module)] = time.perf_counter()

    def _post(self, category: str):
        def hook(module: torch.nn.Module, args: object, output: object) -> None:
            self.ms[category] += 1e3 * (time.perf_counter() - self._starts.pop(id(module)))

        return hook

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def time_calls(obj: object, attr: str, totals: dict[str, float], key: str):
    """Wraps the ctypes function held in `obj.attr` with a timer; returns what undoes it."""
    fn = getattr(obj, attr)

    def timed(*args):
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            totals[key] += 1e3 * (time.perf_counter() - start)

    setattr(obj, attr, timed)
    return lambda: setattr(obj, attr, fn)


def profile_size(engine, n: int, args: argparse.Namespace) -> dict:
    core, model = engine.core, engine.loaded.model
    steps = args.steps
    adapters = [""] if not args.lora or args.base_rows else [f"a{i}" for i in range(args.lora)]
    prompts = make_prompts(n, args.prompt_len, engine.model_config.vocab_size, seed=n)
    admit(engine, prompts, 3 * steps + 8, adapters)
    start = time.perf_counter()
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.running + list(
            core.scheduler.waiting)):  # fmt: skip
        core.step()  # prefill
    prefill_ms = 1e3 * (time.perf_counter() - start)
    for _ in range(4):
        core.step()  # warm decode steps
    # 1. plain
    timer = StepTimer(engine)
    for _ in range(steps):
        core.step()
    timer.restore()
    plain = timer.summary().get(n, {})
    # 2. modules and C kernel calls
    clock = ModuleClock(model)
    kernel_ms: dict[str, float] = defaultdict(float)
    undo = []
    step_fn = core.runner.executor
    if isinstance(step_fn, CpuExecutor) and step_fn.choice.build is not None:
        kernels = load(next(level for level in this_machine_levels() if level.name == step_fn.choice.build))
        for attr, key in (("_rms_norm", "C RMSNorm"), ("_qkv_rope_cache", "C q/k norm + RoPE + KV write"),
                          ("_decode_attention", "C decode attention")):  # fmt: skip
            undo.append(time_calls(kernels, attr, kernel_ms, key))
        bound = step_fn.kernels
        linears = [bound.head, *(getattr(layer, name) for layer in bound.layers
                                 for name in ("qkv", "o", "gate_up", "down"))]  # fmt: skip
        for linear in linears:
            if isinstance(linear, CLinear):
                undo.append(time_calls(linear, "_call", kernel_ms, "C bf16 linear"))
        for fused in step_fn.fused or []:
            undo.append(time_calls(fused, "_attention_in", kernel_ms, "C fused attention_in"))
            undo.append(time_calls(fused, "_mlp_block", kernel_ms, "C fused mlp_block"))
        for layer_lora in (step_fn.c_lora or []) if step_fn.fused is None else []:
            for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
                undo.append(time_calls(getattr(layer_lora, name), "_fn", kernel_ms, "C LoRA delta"))
    head_ms: dict[str, float] = defaultdict(float)
    original_head = step_fn.compute_logits
    step_fn.compute_logits = lambda *a: _timed_head(original_head, head_ms, *a)  # type: ignore[method-assign]
    for _ in range(steps):
        core.step()
    del step_fn.compute_logits  # the instance attribute set above: back to the method
    clock.remove()
    for restore in undo:
        restore()
    # 3. aten ops
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            core.step()
    ops = [(e.key, e.self_cpu_time_total / 1e3 / steps, e.count / steps) for e in prof.key_averages()]
    # torch's own kernels: aten, and oneDNN's packed linears (mkldnn::), which a CPU with oneDNN bf16
    # runs every projection through. The C custom ops are timed in pass 2 instead.
    ops = sorted((o for o in ops if o[0].startswith(("aten::", "mkldnn::"))), key=lambda o: -o[1])
    while core.has_work():
        core.step()
    modules = {k: v / steps for k, v in clock.ms.items()} | {"LM head (logits)": head_ms["head"] / steps}
    return {"plain": plain, "modules": modules, "kernels": {k: v / steps for k, v in kernel_ms.items()},
            "ops": ops, "prefill_ms": prefill_ms}  # fmt: skip


def _timed_head(fn, totals: dict[str, float], *args):
    start = time.perf_counter()
    try:
        return fn(*args)
    finally:
        totals["head"] += 1e3 * (time.perf_counter() - start)


def report(n: int, result: dict) -> None:
    plain, modules, kernels, ops = result["plain"], result["modules"], result["kernels"], result["ops"]
    forward = plain.get("forward", float("nan"))
    aten = sum(ms for _, ms, _ in ops)
    native = sum(kernels.values())
    print(f"\n### N = {n}: decode step {plain.get('step', float('nan')):.2f} ms (median of plain pass); "
          f"prefill of the {n} prompts {result['prefill_ms']:.0f} ms\n")  # fmt: skip
    print("| host phase | ms |\n|---|---|")
    for phase in (*StepTimer.PHASES, "other"):
        print(f"| {phase} | {plain.get(phase, float('nan')):.2f} |")
    print("\n| forward, by module (hooked pass) | ms |\n|---|---|")
    for key, ms in sorted(modules.items(), key=lambda kv: -kv[1]):
        print(f"| {key} | {ms:.2f} |")
    print("\n| inside the forward | ms |\n|---|---|")
    for key, ms in sorted(kernels.items(), key=lambda kv: -kv[1]):
        print(f"| {key} | {ms:.2f} |")
    print(f"| aten and oneDNN ops (self time, {sum(c for *_, c in ops):.0f} ops per step) | {aten:.2f} |")
    print(f"| Python and dispatch (forward - aten - C) | {forward - aten - native:.2f} |")
    print("\n| top aten and oneDNN ops | ms | calls per step |\n|---|---|---|")
    for name, ms, count in ops[:10]:
        print(f"| {name} | {ms:.2f} | {count:.0f} |")


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    model_dir = args.model_dir or resolve_model(None, "bfloat16")
    sizes = [int(s) for s in args.sizes.split(",")]
    workload = argparse.Namespace(prompt_len=args.prompt_len, new_tokens=3 * args.steps + 8,
                                  threads=args.threads, max_num_batched_tokens=4096)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        lora = {}
        if args.lora:
            config = check_checkpoint(model_dir, "bfloat16")
            paths = [write_adapter(Path(tmp) / f"a{i}", config, seed=i) for i in range(args.lora)]
            lora = dict(enable_lora=True, max_loras=args.lora, max_lora_rank=RANK,
                        loras=tuple((f"a{i}", path) for i, path in enumerate(paths)))  # fmt: skip
        quantized = {}
        if args.quantization == "gguf":
            activations = args.quantized_activations
            quantized = dict(quantized_from=default_model_file(), quantized_activations=activations)
        engine = build_engine(model_dir, workload, max(sizes), start=False, **lora, **quantized)
    profile(engine, args, model_dir, sizes)


def profile(engine, args: argparse.Namespace, model_dir: Path, sizes: list[int]) -> None:
    model = engine.loaded.model
    executor = engine.core.runner.executor
    if args.path in ("modules", "torch") and isinstance(executor, CpuExecutor) and executor.choice.build:
        kernels = load(next(level for level in this_machine_levels() if level.name == executor.choice.build))
        linears = "torch" if args.path == "torch" else executor.choice.linears
        engine.core.runner.executor = CpuExecutor(
            model, kernels, linears=linears, use_stack=False, lora=engine.lora
        )
    rows = " loaded, base rows" if args.base_rows else " mixed"
    lora = f", {args.lora} LoRA adapters{rows}" if args.lora else ""
    print(f"model {model_dir}, threads {args.threads}, path {args.path}{lora}, "
          f"{executor.choice.describe() if isinstance(executor, CpuExecutor) else ''}, "
          f"load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    for n in sizes:
        # On the engine thread, as the loop would step it (the one-thread rule, engine/front/loop.py).
        report(n, engine._thread.run(profile_size, engine, n, args))
    print(f"\nload average at the end {os.getloadavg()[0]:.2f}")
    engine.shutdown()


if __name__ == "__main__":
    main()
