"""Decode benchmark on an accelerator, eager and compiled, as one table (run by scripts/device_check.sh).

For each model shape (random weights, made on first use under ~/.cache/tandem/models/<shape>) and each
mode (eager dynamic shapes; static shapes with compiled decode buckets), in bf16 on `--device`:

- tokens/s with N = 1, 8, 32 concurrent requests (128 prompt tokens, 64 greedy new tokens each, wall
  time from the first submission to the last finish, prefill included, as bench/decode_throughput.py);
- TTFT of one request with a 2048-token prompt;
- parity: greedy tokens of the same prompts in float32 on the device against float32 on the CPU.

Not run in the repository's own sessions (no GPU was lent to them): see docs/PERFORMANCE.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.decode_throughput import make_prompts, run_tandem  # noqa: E402
from services.decoder.backends.backend import check_available  # noqa: E402
from services.decoder.config import EngineConfig  # noqa: E402
from services.decoder.engine.engine import Engine  # noqa: E402
from services.decoder.engine.outputs import Delta, OutputOptions  # noqa: E402
from services.decoder.engine.params import SamplingParams, StoppingParams  # noqa: E402
from services.decoder.engine.prompt import GenerateSpec  # noqa: E402
from services.decoder.models.random_model import make_model  # noqa: E402

CACHE = Path.home() / ".cache" / "tandem" / "models"
# Static mode: decode buckets at the benchmarked batch sizes, one spare for prefill padding sequences.
SEQ_BUCKETS = (1, 8, 32, 64)
TOKEN_BUCKETS = (1, 8, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def model_dir(shape: str) -> Path:
    path = CACHE / shape
    if not (path / "model.safetensors").exists():
        print(f"creating the {shape} checkpoint in {path} ...", flush=True)
        make_model(path, shape=shape, seed=0)
    return path


def engine(path: Path, device: str, dtype: str, compiled: bool) -> Engine:
    static = dict(static_shapes=True, compile=True, seq_buckets=SEQ_BUCKETS, token_buckets=TOKEN_BUCKETS)
    config = EngineConfig(
        model_dir=path,
        device=device,
        dtype=dtype,
        max_num_seqs=32,
        max_num_batched_tokens=4096,
        max_model_len=4096,
        kv_cache_bytes=4 * 1024**3 if device != "cpu" else 512 * 1024**2,
        enable_prefix_caching=False,
        **(static if compiled else {}),
    )
    start = time.perf_counter()
    built = Engine(config).start()  # static mode: warmup (and compiles) happen here
    compiler = built.core.runner.compiler
    note = f", {compiler.num_graphs} graphs in {compiler.compile_s:.1f} s" if compiler else ""
    mode = "compiled" if compiled else "eager"
    print(f"  {device} {dtype} {mode}: ready in {time.perf_counter() - start:.1f} s{note}", flush=True)
    return built


def greedy_tokens(eng: Engine, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    out = []
    for prompt in prompts:
        spec = GenerateSpec(
            [prompt],
            SamplingParams(temperature=0.0),
            StoppingParams(max_new_tokens=new_tokens, ignore_eos=True),
            OutputOptions(include_text=False),
        )
        out.append([t for e in eng.generate(spec) if isinstance(e, Delta) for t in e.token_ids])
    return out


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shapes", default="bench-small,qwen3-0.6b")
    parser.add_argument("--sizes", default="1,8,32")
    parser.add_argument("--ttft-prompt-len", type=int, default=2048)
    args = parser.parse_args()
    check_available(args.device)
    sizes = [int(n) for n in args.sizes.split(",")]
    rows = []
    for shape in args.shapes.split(","):
        path = model_dir(shape)
        parity_prompts = make_prompts(4, 32, 1000, seed=7)
        with Engine(
            EngineConfig(model_dir=path, dtype="float32", max_model_len=4096, enable_prefix_caching=False)
        ) as cpu:
            reference = greedy_tokens(cpu, parity_prompts, 16)
        for compiled in (False, True):
            with engine(path, args.device, "float32", compiled) as eng:
                parity = greedy_tokens(eng, parity_prompts, 16)
            equal = sum(
                a == b for x, y in zip(parity, reference, strict=True) for a, b in zip(x, y, strict=True)
            )
            with engine(path, args.device, "bfloat16", compiled) as eng:
                run_tandem(eng, make_prompts(2, 128, 1000, seed=1), 8)  # warm the allocator and caches
                tok_s = []
                for n in sizes:
                    result, _ = run_tandem(eng, make_prompts(n, 128, 1000, seed=n), 64)
                    tok_s.append(result.tokens_per_s)
                ttft, _ = run_tandem(eng, make_prompts(1, args.ttft_prompt_len, 1000, seed=2), 1)
            rows.append(
                (shape, "compiled" if compiled else "eager", tok_s, ttft.ttft_median_s, equal, 4 * 16)
            )
    print()
    size_cols = " | ".join(f"tok/s N={n}" for n in sizes)
    print(f"| model | mode | {size_cols} | TTFT {args.ttft_prompt_len} tok (ms) | fp32 tokens equal to CPU |")
    print("|---|---|" + "---|" * len(sizes) + "---|---|")
    for shape, mode, tok_s, ttft_s, equal, total in rows:
        cells = " | ".join(f"{t:.0f}" for t in tok_s)
        print(f"| {shape} | {mode} | {cells} | {ttft_s * 1000:.0f} | {equal}/{total} |")
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA"
    print(f"\ndevice: {args.device} ({gpu})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
