"""The Neuron backend on XLA, timed beside the CPU backend in the same run: a record, not a target.

On XLA's CPU device (PJRT_DEVICE=CPU, every machine here) this says what compiling and running the
Neuron backend's graphs costs where they are tested; on a Neuron instance (PJRT_DEVICE=NEURON,
scripts/neuron_check.sh) the same script gives the NeuronCores' figures. Per configuration, each in
a process of its own (a process holds one XLA runtime of a fixed device count):

- compile time of each graph and in all, and the whole warmup;
- decode step time at 1 and 8 requests (64 greedy tokens each: the time after the first token,
  per token);
- prefill of a 512-position prompt (time to first token, median of --repeats, no prefix cache).

Configurations: the CPU backend, then the XLA backend on 1 and 2 devices (--devices).

    .venv-xla/bin/python bench/xla_backend.py [--dtype bfloat16] [--devices 1,2] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PROMPT_TOKENS = 512
DECODE_TOKENS = 64
LIMITS = dict(max_num_seqs=8, max_num_batched_tokens=PROMPT_TOKENS, max_model_len=1024, num_kv_blocks=600)
BUCKETS = dict(seq_buckets=(1, 8), token_buckets=(PROMPT_TOKENS,), block_table_buckets=(64,))


def run_one(device: str, num_devices: int, dtype: str, repeats: int) -> dict[str, object]:
    """One configuration in this process."""
    from tandem.common.torch_part.model_cache import resolve_model
    from tandem.decoder.backends.cpu.isa import this_cpu
    from tandem.decoder.config import EngineConfig
    from tandem.decoder.engine.admission.prompt import GenerateSpec
    from tandem.decoder.engine.front.engine import Engine
    from tandem.decoder.engine.outputs.outputs import Finished
    from tandem.decoder.engine.params import SamplingParams, StoppingParams

    xla = device == "neuron"
    extra = dict(static_shapes=True, compile=True, num_devices=num_devices, **BUCKETS) if xla else {}
    config = EngineConfig(
        model_dir=resolve_model(None, dtype),
        dtype=dtype,
        device=device,
        enable_prefix_caching=False,
        **LIMITS,
        **extra,
    )
    engine = Engine(config)
    start = time.perf_counter()
    engine.start()
    result: dict[str, object] = {"device": device, "num_devices": num_devices, "dtype": dtype}
    result["warmup_s"] = time.perf_counter() - start
    if xla:
        import torch_xla.debug.metrics as metrics

        samples = metrics.metric_data("CompileTime")[2]
        result["compile_s"] = [value / 1e9 for _, value in samples]
        result["compile_total_s"] = sum(result["compile_s"])  # type: ignore[arg-type]
    cpu = this_cpu()
    result["cpu"] = f"{cpu.model_name} ({cpu.isa_summary})"

    def finished(spec: GenerateSpec) -> Finished:
        return [e for e in engine.generate(spec) if isinstance(e, Finished)][0]

    try:
        ttfts = []
        for r in range(repeats):
            ids = [(31 * j + 7 * r) % 40000 + 100 for j in range(PROMPT_TOKENS - 1)]
            done = finished(
                GenerateSpec([ids], SamplingParams(temperature=0.0), StoppingParams(1, ignore_eos=True))
            )
            ttfts.append(done.time_to_first_token_s)
        result["prefill_512_ms"] = 1e3 * statistics.median(ttfts)
        for num_requests in (1, 8):
            from services.decoder.tests.engine.engine_helpers import run_concurrently

            specs = [
                GenerateSpec(
                    [[100 + 17 * i + j for j in range(16)]],
                    SamplingParams(temperature=0.0),
                    StoppingParams(DECODE_TOKENS, ignore_eos=True),
                )
                for i in range(num_requests)
            ]
            events = run_concurrently(engine, specs)
            ends = [e[-1] for e in events]
            per_token = [(f.total_time_s - f.time_to_first_token_s) / (DECODE_TOKENS - 1) for f in ends]
            result[f"decode_step_ms_at_{num_requests}"] = 1e3 * max(per_token)
    finally:
        engine.shutdown()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--devices", default="1,2", help="XLA device counts, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, help="write the results here too")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # DEVICE:N, run in a child process
    args = parser.parse_args()
    if args.one:
        device, n = args.one.split(":")
        print(json.dumps(run_one(device, int(n), args.dtype, args.repeats)), flush=True)
        return
    runs = [("cpu", 1)] + [("neuron", int(n)) for n in args.devices.split(",")]
    results = []
    for device, n in runs:
        env = {k: v for k, v in os.environ.items() if k != "CPU_NUM_DEVICES"}
        argv = [
            sys.executable,
            __file__,
            "--one",
            f"{device}:{n}",
            "--dtype",
            args.dtype,
            "--repeats",
            str(args.repeats),
        ]
        out = subprocess.run(argv, env=env, capture_output=True, text=True, check=True).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
        print(json.dumps(results[-1]), flush=True)
    print(f"\nCPU: {results[0]['cpu']}; load average {os.getloadavg()[0]:.1f}")
    print("| backend | warmup s | compile s (per graph) | prefill 512 ms | decode step ms at 1 / 8 |")
    print("|---|---|---|---|---|")
    for r in results:
        name = "cpu" if r["device"] == "cpu" else f"xla x{r['num_devices']}"
        compile_s = (
            f"{r['compile_total_s']:.1f} ({', '.join(f'{s:.1f}' for s in r['compile_s'])})"
            if "compile_s" in r
            else "-"
        )
        print(
            f"| {name} | {r['warmup_s']:.1f} | {compile_s} | {r['prefill_512_ms']:.0f} | "
            f"{r['decode_step_ms_at_1']:.1f} / {r['decode_step_ms_at_8']:.1f} |"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
