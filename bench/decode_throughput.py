"""Offline decode throughput: Tandem's in-process Engine against Hugging Face `transformers.generate`.

Both run the same checkpoint (bench-small, bf16, made on demand) and the same workload in one process:
N concurrent requests, each a prompt of `--prompt-len` random token IDs followed by exactly
`--new-tokens` greedy tokens (EOS ignored). For each N:

- Tandem: the N requests are submitted back to back to a running Engine (continuous batching does the
  rest); the wall time runs from the first submission to the last Finished event.
- transformers: the N prompts form one batch (same length, so no padding) for one `generate` call with
  `do_sample=False, min_new_tokens = max_new_tokens`; the wall time is that call.

tokens/s = N * new_tokens / wall time (prefill included). TTFT is the median over the N requests of the
time from submission to the first sampled token (for transformers: the end of the batched prefill).
The VM this runs on is noisy: both engines are warmed up first, runs are interleaved (engine order
alternates each repeat), and the median of `--repeats` runs is reported.

Run: `make bench`, or `.venv/bin/python bench/decode_throughput.py --sizes 1,8,32 --repeats 3`.
`--breakdown` adds a per-step time split of Tandem's decode steps (scheduler, batch building, forward,
sampler, events) measured by timing wrappers around the engine's own methods.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tandem.common.torch_part.random_model import make_model  # noqa: E402
from tandem.decoder.config import EngineConfig  # noqa: E402
from tandem.decoder.engine.admission.prompt import EmbeddingPrompt, GenerateSpec  # noqa: E402
from tandem.decoder.engine.front.engine import Engine  # noqa: E402
from tandem.decoder.engine.outputs.outputs import Delta, Event, Failed, Finished, OutputOptions  # noqa: E402
from tandem.decoder.engine.params import SamplingParams, StoppingParams  # noqa: E402
from tandem.decoder.engine.step.sizing import max_token_budget  # noqa: E402

DEFAULT_MODEL_DIR = Path.home() / ".cache" / "tandem" / "models" / "bench-small"
BLOCK_SIZE = 16


@dataclass
class RunResult:
    engine: str  # "tandem" or "transformers"
    num_requests: int
    wall_s: float
    tokens: int  # generated tokens counted
    ttft_median_s: float
    steps: int | None = None  # engine steps (Tandem only)
    # From the last request's first token to the last token: decode steps only (prefill excluded)
    decode_s: float | None = None

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens after each request's first, over decode_s."""
        if not self.decode_s:
            return None
        return (self.tokens - self.num_requests) / self.decode_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s


@dataclass
class SizeSummary:
    num_requests: int
    tandem_tok_s: float
    transformers_tok_s: float
    ratio: float
    tandem_ttft_ms: float
    transformers_ttft_ms: float
    tandem_runs_tok_s: list[float] = field(default_factory=list)
    transformers_runs_tok_s: list[float] = field(default_factory=list)
    token_agreement: float | None = None  # fraction of generated tokens equal in both (informational)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="1,8,32", help="comma-separated concurrent request counts")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per size and engine (median kept)")
    parser.add_argument("--new-tokens", type=int, default=64, help="generated tokens per request")
    parser.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per request")
    parser.add_argument(
        "--model-dir", type=Path, default=None, help=f"checkpoint (default {DEFAULT_MODEL_DIR})"
    )
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096, help="Tandem's step token budget")
    parser.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")
    parser.add_argument("--breakdown", action="store_true", help="time Tandem's decode steps by phase")
    parser.add_argument("--skip-transformers", action="store_true", help="run Tandem only")
    return parser.parse_args()


def ensure_model(model_dir: Path | None) -> Path:
    if model_dir is not None:
        if not (model_dir / "config.json").exists():
            raise SystemExit(f"{model_dir} has no config.json")
        return model_dir
    if not (DEFAULT_MODEL_DIR / "model.safetensors").exists():
        print(f"creating the bench-small checkpoint in {DEFAULT_MODEL_DIR} ...", flush=True)
        make_model(DEFAULT_MODEL_DIR, shape="bench-small", seed=0)
    return DEFAULT_MODEL_DIR


def make_prompts(num_requests: int, prompt_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    # IDs below 1000 stay inside the embedded tokenizer's learned vocabulary and away from its specials.
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, min(1000, vocab_size), (num_requests, prompt_len), generator=generator).tolist()


# -- Tandem ---------------------------------------------------------------------------------------


def num_kv_blocks(args: argparse.Namespace, max_requests: int) -> int:
    """KV blocks for `max_requests` of `args.prompt_len + args.new_tokens`, the reserved null block
    and 8 of slack: the engine's (build_engine) and the gRPC server's (grpc_throughput) pool."""
    blocks_per_request = -(-(args.prompt_len + args.new_tokens) // BLOCK_SIZE)
    return max_requests * blocks_per_request + 1 + 8


def token_budget(requested: int, max_requests: int, num_blocks: int) -> int:
    """The step token budget for `--max-num-batched-tokens requested` beside a pool of `num_blocks`:
    one token per request at least, and no more than the decoder takes beside that pool, its
    positions (never under the decoder's default): sizing.max_token_budget, check_token_budget's bound.

    The cap changes no step, so figures stay comparable with runs from before the decoder refused
    such budgets: every position a step computes takes a KV slot, so no step ever filled more than
    the pool, and the cap is never under 2,048, so the CPU kernels' prefill sizes (128, 512) are timed
    as before. `--quick` (sizes 1, 8) asked 4,096 beside 104 blocks of 16 (1,664 positions)."""
    return min(max(requested, max_requests), max_token_budget(BLOCK_SIZE, num_blocks))


def build_engine(
    model_dir: Path,
    args: argparse.Namespace,
    max_requests: int,
    enable_prefix_caching: bool = False,
    start: bool = True,
    quantized_from: Path | None = None,
    quantized_activations: str = "none",
    **overrides: object,  # more EngineConfig fields (LoRA's, for bench/profile_step.py --lora)
) -> Engine:
    """An engine (started unless `start` is False) with KV blocks for `max_requests` of
    `args.prompt_len + args.new_tokens`; with `quantized_from` (the GGUF file model_dir was imported
    from), serving that file's quantized weights (`--quantization gguf`), their inputs as
    `quantized_activations` says (`--quantized-activations`)."""
    num_blocks = num_kv_blocks(args, max_requests)
    config = EngineConfig(
        model_dir=model_dir,
        dtype="bfloat16",
        max_num_seqs=max(32, max_requests),
        max_num_batched_tokens=token_budget(args.max_num_batched_tokens, max_requests, num_blocks),
        block_size=BLOCK_SIZE,
        num_kv_blocks=num_blocks,
        enable_prefix_caching=enable_prefix_caching,
        num_threads=args.threads,
        max_queue=max(1024, max_requests),
        quantization="none" if quantized_from is None else "gguf",
        quantized_from=quantized_from,
        quantized_activations=quantized_activations,
        **overrides,
    )
    # The engine loads the model on its own thread: torch work on a second thread would slow its steps.
    engine = Engine(config)
    return engine.start() if start else engine


def run_tandem(
    engine: Engine, prompts: Sequence[list[int] | EmbeddingPrompt], new_tokens: int
) -> tuple[RunResult, list[list[int]]]:
    """Submit one request per prompt (token IDs or embedding rows) back to back; wait for them all."""
    n = len(prompts)
    tokens: list[list[int]] = [[] for _ in prompts]
    finished: list[Finished | None] = [None] * n
    done = threading.Semaphore(0)
    end_times: list[float] = [0.0] * n

    def sink_for(i: int):
        def sink(event: Event) -> None:
            if isinstance(event, Delta):
                tokens[i].extend(event.token_ids)
            elif isinstance(event, Finished):
                end_times[i] = time.perf_counter()
                finished[i] = event
                done.release()
            elif isinstance(event, Failed):
                end_times[i] = time.perf_counter()
                done.release()

        return sink

    specs = [
        GenerateSpec(
            [prompt],
            SamplingParams(temperature=0.0),
            StoppingParams(max_new_tokens=new_tokens, ignore_eos=True),
            OutputOptions(include_text=False),
        )
        for prompt in prompts
    ]
    steps_before = engine.core.num_steps
    submitted = [0.0] * n
    start = time.perf_counter()
    for i, spec in enumerate(specs):
        submitted[i] = time.perf_counter()
        engine.submit(spec, sink_for(i))
    for _ in specs:
        if not done.acquire(timeout=600):
            raise RuntimeError("Tandem did not finish within 600 s")
    wall = max(end_times) - start
    if any(f is None for f in finished):
        raise RuntimeError("a Tandem request failed")
    generated = sum(f.output_tokens for f in finished if f is not None)
    if generated != n * new_tokens:
        raise RuntimeError(f"Tandem generated {generated} tokens, expected {n * new_tokens}")
    ttft = statistics.median(f.time_to_first_token_s for f in finished if f is not None)
    steps = engine.core.num_steps - steps_before
    # A request's TTFT runs from its submission; the last first token opens the decode-only window.
    last_first = max(t + f.time_to_first_token_s for t, f in zip(submitted, finished, strict=True) if f)
    decode_s = max(end_times) - last_first
    return RunResult("tandem", n, wall, generated, ttft, steps, decode_s), tokens


# -- transformers ---------------------------------------------------------------------------------


class _FirstCallTimer:
    """A logits processor that notes when the first token's logits are ready (end of prefill)."""

    def __init__(self) -> None:
        self.first: float | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.first is None:
            self.first = time.perf_counter()
        return scores


def load_transformers(model_dir: Path, dtype: torch.dtype = torch.bfloat16):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model.train(False)
    return model


def run_transformers(model, prompts: list[list[int]], new_tokens: int) -> tuple[RunResult, list[list[int]]]:
    from transformers import LogitsProcessorList

    n, prompt_len = len(prompts), len(prompts[0])
    input_ids = torch.tensor(prompts, dtype=torch.long)
    timer = _FirstCallTimer()
    with torch.inference_mode():
        start = time.perf_counter()
        out = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=0,
            logits_processor=LogitsProcessorList([timer]),
        )
        wall = time.perf_counter() - start
    generated = out[:, prompt_len:]
    if generated.shape != (n, new_tokens):
        raise RuntimeError(
            f"transformers generated shape {tuple(generated.shape)}, expected {(n, new_tokens)}"
        )
    ttft = (timer.first or start) - start
    result = RunResult("transformers", n, wall, n * new_tokens, ttft, decode_s=wall - ttft)
    return result, generated.tolist()


# -- per-step breakdown ----------------------------------------------------------------------------


class StepTimer:
    """Wraps the engine's own methods (instance attributes only; engine code is unchanged)."""

    PHASES = ("schedule", "prepare", "forward", "sample", "update", "emit")

    def __init__(self, engine: Engine) -> None:
        self.core = engine.core
        self.current: dict[str, float] = {}
        self.steps: list[tuple[int, bool, dict[str, float]]] = []  # (batch, decode-only, phase -> s)
        self._batch_builds = 0
        core, runner, scheduler = self.core, self.core.runner, self.core.scheduler
        self._originals = {
            (scheduler, "schedule"): scheduler.schedule,
            (scheduler, "update"): scheduler.update,
            (runner, "prepare"): runner.prepare,
            (runner, "forward"): runner.forward,
            (core, "_sample"): core._sample,
            (core, "_outputs"): core._outputs,  # emit: a step's outputs made, then delivered to streams
            (core, "_deliver"): core._deliver,
            (core, "step"): core.step,
        }
        for (obj, name), fn in self._originals.items():
            phase = {"_sample": "sample", "_outputs": "emit", "_deliver": "emit"}.get(name, name)
            setattr(obj, name, self._step(fn) if name == "step" else self._timed(phase, fn))

    def _timed(self, phase: str, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.current[phase] = self.current.get(phase, 0.0) + time.perf_counter() - t0

        return wrapper

    def _step(self, fn):
        def wrapper(*args, **kwargs):
            self.current = {}
            batch_before = self.core._batch
            plan_holder: list = []
            schedule = self.core.scheduler.schedule

            def capture(*args, **kwargs):  # not_runnable: the requests whose grammar is being rebuilt
                plan = schedule(*args, **kwargs)
                plan_holder.append(plan)
                return plan

            self.core.scheduler.schedule = capture
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.current["step"] = time.perf_counter() - t0
                self.core.scheduler.schedule = schedule
                if self.core._batch is not batch_before:
                    self.current["rebuilt_sampling_batch"] = 1.0
                if plan_holder and not plan_holder[0].is_empty:
                    plan = plan_holder[0]
                    decode_only = all(not item.is_prefill for item in plan.scheduled)
                    self.steps.append((len(plan.scheduled), decode_only, dict(self.current)))

        return wrapper

    def restore(self) -> None:
        for (obj, name), _ in self._originals.items():
            delattr(obj, name)

    def summary(self) -> dict[int, dict[str, float]]:
        """Per batch size, median ms per phase over decode-only steps, and their count."""
        by_batch: dict[int, list[dict[str, float]]] = defaultdict(list)
        for batch, decode_only, phases in self.steps:
            if decode_only:
                by_batch[batch].append(phases)
        out: dict[int, dict[str, float]] = {}
        for batch, rows in sorted(by_batch.items()):
            row = {p: 1e3 * statistics.median(r.get(p, 0.0) for r in rows) for p in (*self.PHASES, "step")}
            row["other"] = row["step"] - sum(row[p] for p in self.PHASES)
            row["steps"] = len(rows)
            row["sampling_batch_rebuilds"] = sum(r.get("rebuilt_sampling_batch", 0.0) for r in rows)
            out[batch] = row
        return out


# -- main -----------------------------------------------------------------------------------------


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    same = total = 0
    for x, y in zip(a, b, strict=True):
        same += sum(int(p == q) for p, q in zip(x, y, strict=False))
        total += max(len(x), len(y))
    return same / total if total else 0.0


def main() -> None:
    args = parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model_dir = ensure_model(args.model_dir)
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, cpus {os.cpu_count()}, "
        f"{platform.processor() or platform.machine()}; model {model_dir}",
        flush=True,
    )

    engine = build_engine(model_dir, args, max(sizes))
    vocab = engine.model_config.vocab_size
    hf_model = None if args.skip_transformers else load_transformers(model_dir)
    workloads = {n: make_prompts(n, args.prompt_len, vocab, seed=n) for n in sizes}

    # Warm-up: every batch size once on each engine (first-use allocations, oneDNN primitive caches).
    warm_tokens = min(8, args.new_tokens)
    for n in sizes:
        warm_prompts = make_prompts(n, args.prompt_len, vocab, seed=10_000 + n)
        run_tandem(engine, warm_prompts, warm_tokens)
        if hf_model is not None:
            run_transformers(hf_model, warm_prompts, warm_tokens)
    print("warm-up done", flush=True)

    results: dict[tuple[str, int], list[RunResult]] = defaultdict(list)
    outputs: dict[tuple[str, int], list[list[int]]] = {}
    for repeat in range(args.repeats):
        for n in sizes:
            order = ["tandem", "transformers"] if repeat % 2 == 0 else ["transformers", "tandem"]
            for name in order:
                if name == "transformers" and hf_model is None:
                    continue
                if name == "tandem":
                    result, tokens = run_tandem(engine, workloads[n], args.new_tokens)
                else:
                    result, tokens = run_transformers(hf_model, workloads[n], args.new_tokens)
                results[(name, n)].append(result)
                outputs[(name, n)] = tokens
                steps = f", {result.steps} steps" if result.steps is not None else ""
                print(
                    f"  repeat {repeat + 1}/{args.repeats}  N={n:<3} {name:<12} "
                    f"{result.tokens_per_s:8.1f} tok/s  wall {result.wall_s:6.2f} s  "
                    f"TTFT {1e3 * result.ttft_median_s:7.1f} ms{steps}",
                    flush=True,
                )

    summaries: list[SizeSummary] = []
    for n in sizes:
        tandem = results[("tandem", n)]
        hf = results.get(("transformers", n), [])
        t_tps = statistics.median(r.tokens_per_s for r in tandem)
        h_tps = statistics.median(r.tokens_per_s for r in hf) if hf else float("nan")
        summaries.append(
            SizeSummary(
                num_requests=n,
                tandem_tok_s=t_tps,
                transformers_tok_s=h_tps,
                ratio=t_tps / h_tps if hf else float("nan"),
                tandem_ttft_ms=1e3 * statistics.median(r.ttft_median_s for r in tandem),
                transformers_ttft_ms=1e3 * statistics.median(r.ttft_median_s for r in hf)
                if hf
                else float("nan"),
                tandem_runs_tok_s=[round(r.tokens_per_s, 1) for r in tandem],
                transformers_runs_tok_s=[round(r.tokens_per_s, 1) for r in hf],
                token_agreement=agreement(outputs[("tandem", n)], outputs[("transformers", n)])
                if hf
                else None,
            )
        )

    breakdown = None
    if args.breakdown:
        timer = StepTimer(engine)
        for n in sizes:
            run_tandem(engine, workloads[n], args.new_tokens)
        timer.restore()
        breakdown = timer.summary()
    engine.shutdown()

    print()
    print(
        f"Decode throughput, {model_dir.name} bf16, prompt {args.prompt_len} random tokens, "
        f"{args.new_tokens} new tokens (greedy, EOS ignored), median of {args.repeats} runs"
    )
    header = (
        f"{'N':>4} | {'Tandem tok/s':>12} | {'HF tok/s':>9} | {'ratio':>6} | "
        f"{'Tandem TTFT ms':>14} | {'HF TTFT ms':>10} | runs Tandem / HF (tok/s)"
    )
    print(header)
    print("-" * len(header))
    for s in summaries:
        print(
            f"{s.num_requests:>4} | {s.tandem_tok_s:>12.1f} | {s.transformers_tok_s:>9.1f} | "
            f"{s.ratio:>5.2f}x | {s.tandem_ttft_ms:>14.1f} | {s.transformers_ttft_ms:>10.1f} | "
            f"{s.tandem_runs_tok_s} / {s.transformers_runs_tok_s}"
        )
    targets = {max(sizes): 2.0, min(sizes): 1.0}
    for n, target in sorted(targets.items()):
        s = next(s for s in summaries if s.num_requests == n)
        verdict = "met" if s.ratio >= target else "NOT met"
        print(f"target at N={n}: >= {target:.1f}x transformers -> {s.ratio:.2f}x ({verdict})")
    for s in summaries:
        if s.token_agreement is not None:
            print(
                f"N={s.num_requests}: {100 * s.token_agreement:.0f}% of generated tokens equal transformers' "
                "(informational: bf16 rounding differs between the two, so greedy paths may diverge)"
            )
    if breakdown:
        print()
        print("Tandem decode-step breakdown (median ms per decode-only step):")
        cols = (*StepTimer.PHASES, "other", "step")
        print(f"{'batch':>5} | " + " | ".join(f"{c:>8}" for c in cols) + " | steps | SamplingBatch rebuilds")
        for batch, row in breakdown.items():
            print(
                f"{batch:>5} | "
                + " | ".join(f"{row[c]:>8.2f}" for c in cols)
                + f" | {int(row['steps']):>5} | {int(row['sampling_batch_rebuilds'])}"
            )

    if args.json is not None:
        payload = {
            "workload": {
                "model": str(model_dir),
                "dtype": "bfloat16",
                "prompt_len": args.prompt_len,
                "new_tokens": args.new_tokens,
                "repeats": args.repeats,
                "threads": args.threads,
            },
            "sizes": [asdict(s) for s in summaries],
            "runs": [asdict(r) | {"tokens_per_s": r.tokens_per_s} for rs in results.values() for r in rs],
            "breakdown_ms": breakdown,
        }
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
