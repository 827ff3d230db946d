"""Two checkouts' engine steps, A against B: the CPU time of each step, the whole process's.

For a change that must cost nothing (a refactor of what crosses the step, the model and the executor:
issue 50), on a machine shared with other work. Each sample is a process of its own, run with the
checkout's own venv and code (`A/.venv/bin/python bench/forward_ab.py --sample` with A as its working
directory; A need not hold this file), which builds
the engine with bench/decode_throughput.py's `build_engine`, warms up, and times every call of the
step runner's `_execute` (packing the plan and the forward) with `time.process_time`: CPU time, which
a neighbour's load barely moves where a wall clock reads 5-7x its minimum. The process's, not the
engine thread's: the CPU kernels run on a team of threads of their own (the engine thread's own time
was a quarter of a decode step's), and nothing else in the process runs while a step does (the
caller waits on a semaphore).
Samples alternate ABBAAB; the report is each step kind's minimum and median per arm.

    python bench/forward_ab.py --a /path/to/base --b /path/to/branch [--rounds 1] [--threads 1]

The default model (SmolLM2-135M-Instruct, bf16). Decode steps at N = 1, 8 and 32 (32 new tokens
after 128 prompt tokens): a per-step cost shows most there, the N = 1 step being the shortest the
engine runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

SIZES = (1, 8, 32)
ORDER = "ABBAAB"


def sample(threads: int, repeats: int) -> dict[str, list[float]]:
    """This checkout's engine: {"decode N": [ms of CPU time per step, ...]} over `repeats` runs per N."""
    sys.path.insert(0, str(Path.cwd() / "bench"))
    import decode_throughput as bench  # the checkout's own harness (the cwd), on its own code

    args = argparse.Namespace(prompt_len=128, new_tokens=32, threads=threads, max_num_batched_tokens=4096)
    from tandem.common.torch_part.model_cache import resolve_model

    model_dir = resolve_model(None)  # the default model, SmolLM2-135M-Instruct in bf16
    engine = bench.build_engine(model_dir, args, max_requests=max(SIZES))
    runner = engine.core.runner
    times: dict[str, list[float]] = {}
    timing = [False]
    execute = runner._execute

    def timed(plan):  # on the engine's thread
        start = time.process_time()
        out = execute(plan)
        spent = time.process_time() - start
        if timing[0] and all(not item.is_prefill for item in plan.scheduled):
            times.setdefault(f"decode N = {len(plan.scheduled)}", []).append(spent * 1e3)
        return out

    runner._execute = timed
    try:
        vocab = engine.model_config.vocab_size
        for size in SIZES:  # warm-up: every shape once
            bench.run_tandem(
                engine, bench.make_prompts(size, args.prompt_len, vocab, seed=0), args.new_tokens
            )
        timing[0] = True
        for repeat in range(repeats):
            for size in SIZES:
                prompts = bench.make_prompts(size, args.prompt_len, vocab, seed=1 + repeat)
                bench.run_tandem(engine, prompts, args.new_tokens)
    finally:
        engine.shutdown()
    return {kind: values for kind, values in times.items() if kind in {f"decode N = {n}" for n in SIZES}}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--a", type=Path, help="the base checkout (with its .venv)")
    parser.add_argument("--b", type=Path, help="the changed checkout (with its .venv)")
    parser.add_argument("--rounds", type=int, default=1, help="times the ABBAAB order runs")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--repeats", type=int, default=2, help="runs per N in each sample process")
    parser.add_argument("--sample", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, default=None, help="also write every sample here")
    args = parser.parse_args()
    if args.sample:
        print(json.dumps(sample(args.threads, args.repeats)))
        return
    if args.a is None or args.b is None:
        parser.error("--a and --b name the two checkouts")
    arms: dict[str, dict[str, list[float]]] = {"A": {}, "B": {}}
    for arm in ORDER * args.rounds:
        root = (args.a if arm == "A" else args.b).resolve()
        # This file, run by the arm's venv in the arm's checkout (which need not have this file).
        argv = [str(root / ".venv/bin/python"), str(Path(__file__).resolve()), "--sample"]
        argv += ["--threads", str(args.threads), "--repeats", str(args.repeats)]
        result = subprocess.run(argv, cwd=root, capture_output=True, text=True, check=True)
        for kind, values in json.loads(result.stdout.strip().splitlines()[-1]).items():
            arms[arm].setdefault(kind, []).extend(values)
        print(f"{arm} done", file=sys.stderr, flush=True)
    print("| step | n (A/B) | A min ms | B min ms | B/A min | A median | B median | B/A median |")
    print("|---|---|---|---|---|---|---|---|")
    for kind in (f"decode N = {n}" for n in SIZES):
        a, b = arms["A"].get(kind, []), arms["B"].get(kind, [])
        if not a or not b:
            continue
        ma, mb, da, db = min(a), min(b), statistics.median(a), statistics.median(b)
        row = [kind, f"{len(a)}/{len(b)}", ma, mb, mb / ma, da, db, db / da]
        print("| " + " | ".join(f"{v:.2f}" if isinstance(v, float) else v for v in row) + " |")
    if args.json is not None:
        args.json.write_text(json.dumps(arms))


if __name__ == "__main__":
    main()
