"""Structured output's cost (issue 34): tokens/s with a JSON schema against without, at 1 / 8 / 32
concurrent requests, and the first-token delay a fresh schema adds (compiling it and the first mask),
on one in-process engine (the default model, SmolLM2-135M-Instruct bf16, 2 threads).

Both arms run the same prompt for the same number of tokens: the free arm with `ignore_eos` and 48
tokens; the constrained arm under a schema whose answer is long enough to take 48 tokens (an array of
short strings), `max_new_tokens` 48 (so both stop by LENGTH at 48). The arms alternate per repeat, the
median of `--repeats` kept. Nothing is asserted.

Run: `.venv/bin/python bench/structured_output.py [--repeats 3]` (about 2 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from tandem.common.torch_part.model_cache import default_model_file, resolve_model  # noqa: E402
from tandem.decoder.backends.cpu.isa import this_cpu  # noqa: E402
from tandem.decoder.config import EngineConfig  # noqa: E402
from tandem.decoder.engine.admission.prompt import GenerateSpec, TextPrompt  # noqa: E402
from tandem.decoder.engine.front.engine import Engine  # noqa: E402
from tandem.decoder.engine.outputs.outputs import Delta, Finished  # noqa: E402
from tandem.decoder.engine.params import SamplingParams, StoppingParams, StructuredOutput  # noqa: E402
from tandem.decoder.models.loader import load_model  # noqa: E402

PROMPT = "List twenty fruits as JSON."
NEW_TOKENS = 48
SCHEMA = {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 40, "maxItems": 60}


def _run(engine: Engine, n: int, structured: StructuredOutput | None) -> tuple[float, float]:
    """tokens/s over n concurrent requests, and their median time to first token."""
    stopping = StoppingParams(max_new_tokens=NEW_TOKENS, ignore_eos=structured is None)
    spec = GenerateSpec([TextPrompt(PROMPT)], SamplingParams(temperature=0), stopping, structured=structured)
    firsts: list[float] = []
    counts: list[int] = []

    def one() -> None:
        start, first, count = time.perf_counter(), None, 0
        for event in engine.generate(spec):
            if isinstance(event, Delta):
                first = first or time.perf_counter() - start
                count += len(event.token_ids)
            elif isinstance(event, Finished):
                counts.append(count)
        firsts.append(first or 0.0)

    start = time.perf_counter()
    threads = [threading.Thread(target=one) for _ in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(counts) / (time.perf_counter() - start), statistics.median(firsts)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sizes", default="1,8,32")
    args = parser.parse_args()
    cpu = this_cpu()
    print(f"CPU: {cpu.model_name} [{cpu.isa_summary}], {torch.get_num_threads()} threads")
    model_dir = resolve_model(default_model_file(), "bfloat16")
    engine = Engine(
        EngineConfig(model_dir=model_dir, dtype="bfloat16"), load_model(model_dir, "bfloat16")
    ).start()
    schema = StructuredOutput("json_schema", json.dumps(SCHEMA))
    try:
        # The first structured request also builds the engine's llguidance tokenizer: time it apart.
        start = time.perf_counter()
        engine._grammar_compiler()
        tokenizer_s = time.perf_counter() - start
        fresh = []
        for i in range(5):  # a schema never seen: compile + first mask, on top of an unconstrained TTFT
            novel = StructuredOutput("json_schema", json.dumps(SCHEMA | {"title": f"fresh-{i}"}))
            _, ttft_novel = _run(engine, 1, novel)
            _, ttft_cached = _run(engine, 1, novel)
            fresh.append((ttft_novel - ttft_cached) * 1000)
        sizes = [int(s) for s in args.sizes.split(",")]
        runs: dict[tuple[str, int], list[tuple[float, float]]] = {}
        _run(engine, 1, None)
        for repeat in range(args.repeats):
            for n in sizes:
                arms = [("free", None), ("schema", schema)]
                for name, structured in arms if repeat % 2 == 0 else arms[::-1]:
                    runs.setdefault((name, n), []).append(_run(engine, n, structured))
    finally:
        engine.shutdown()
    print(f"\nllguidance tokenizer built once per engine: {tokenizer_s * 1000:.0f} ms")
    print(f"a fresh schema's added first-token delay: median {statistics.median(fresh):.1f} ms (5 schemas)")
    print("\n| N | free tok/s | schema tok/s | schema / free | free TTFT (ms) | schema TTFT (ms) |")
    print("|---|---|---|---|---|---|")
    for n in sizes:
        free = statistics.median(r for r, _ in runs[("free", n)])
        constrained = statistics.median(r for r, _ in runs[("schema", n)])
        free_ttft = statistics.median(t for _, t in runs[("free", n)]) * 1000
        schema_ttft = statistics.median(t for _, t in runs[("schema", n)]) * 1000
        print(
            f"| {n} | {free:.1f} | {constrained:.1f} | **{constrained / free:.2f}x** | {free_ttft:.0f} | "
            f"{schema_ttft:.0f} |"
        )


if __name__ == "__main__":
    main()
