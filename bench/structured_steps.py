"""Do a step's grammar masks bound it? Decode-step time with N requests under a JSON schema against N
free ones (same prompts, same lengths), stepped by hand on an engine that is not started, and the mask
phase alone.

For each N: N requests of `--prompt-len` random tokens, greedy, are admitted and prefilled, a few warm
decode steps run, then `--steps` decode steps are timed (wall time of `EngineCore.step`), the free and
the constrained arm alternating per repeat. In the constrained arm the helper thread's mask work
(`step_grammar.masks_of`: every constrained row's bitmask, unpacked) is timed by wall and CPU time,
and so is how long the engine thread waited for it after the forward pass: the only time masks add
to a step beyond unpacking and applying them. Steps where a constrained request had finished (its schema
complete) are left out, so every step counted has N constrained rows. Finally, at the last measured
state, the N matchers' bitmasks are filled one by one (as the helper thread does) and in one call of
llguidance's parallel fill (`fill_next_token_bitmask_par`, an `LLExecutor` of `--par-threads`).

Run: `.venv/bin/python bench/structured_steps.py [--sizes 8,32] [--steps 16] [--repeats 3]`
(SmolLM2-135M-Instruct bf16, 2 torch threads).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from decode_throughput import build_engine, make_prompts  # noqa: E402

from tandem.common.torch_part.model_cache import default_model_file, resolve_model  # noqa: E402
from tandem.decoder.backends.cpu.isa import this_cpu  # noqa: E402
from tandem.decoder.engine.admission.prompt import GenerateSpec  # noqa: E402
from tandem.decoder.engine.outputs.outputs import OutputOptions, OutputState  # noqa: E402
from tandem.decoder.engine.params import SamplingParams, StoppingParams, StructuredOutput  # noqa: E402
from tandem.decoder.engine.step import step_grammar  # noqa: E402

# A few fields, strings long enough that no answer completes within the measured steps.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 40, "maxLength": 80},
        "age": {"type": "integer"},
        "city": {"type": "string", "minLength": 40, "maxLength": 80},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 3},
    },
    "required": ["name", "age", "city", "tags"],
    "additionalProperties": False,
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="8,32")
    p.add_argument("--steps", type=int, default=16, help="measured decode steps per arm and repeat")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--par-threads", type=int, default=2, help="the LLExecutor's threads")
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    return p.parse_args()


class MaskClock:
    """Times the helper thread's `masks_of` and the engine thread's forward pass, per step."""

    def __init__(self, engine) -> None:
        self.runner = engine.core.runner
        self.original_masks = step_grammar.masks_of
        self.original_execute = self.runner.execute
        self.mask_wall: list[float] = []
        self.mask_cpu: list[float] = []
        self.wait: list[float] = []  # after the forward pass, until the masks were ready
        self._mask_end = 0.0

        def masks(plan):
            start, cpu = time.perf_counter(), time.thread_time()
            result = self.original_masks(plan)
            self._mask_end = time.perf_counter()
            self.mask_wall.append(self._mask_end - start)
            self.mask_cpu.append(time.thread_time() - cpu)
            return result

        def execute(plan):
            output = self.original_execute(plan)
            forward_end = time.perf_counter()
            self._pending_forward_end = forward_end
            return output

        step_grammar.masks_of = masks
        self.runner.execute = execute

    def settle(self, has_masks: bool) -> None:
        """After a step: how long its masks outlasted its forward pass."""
        if has_masks:
            self.wait.append(max(0.0, self._mask_end - self._pending_forward_end))

    def restore(self) -> None:
        step_grammar.masks_of = self.original_masks
        self.runner.execute = self.original_execute


def admit(engine, prompts: list[list[int]], new_tokens: int, structured: StructuredOutput | None) -> None:
    for prompt in prompts:
        stopping = StoppingParams(max_new_tokens=new_tokens, ignore_eos=structured is None)
        spec = GenerateSpec([prompt], SamplingParams(temperature=0.0), stopping,
                            OutputOptions(include_text=False), structured=structured)  # fmt: skip
        request = engine.make_request(spec)
        output = OutputState(request.request_id, request.prompt_token_ids, request.is_token_ids,
                             request.stopping, spec.output, engine.tokenizer, engine.eos_token_ids,
                             engine.max_model_len, request.arrival_time)  # fmt: skip
        engine.core.add(request, output, lambda event: None, None)


def run_arm(engine, n: int, args, structured: StructuredOutput | None) -> dict:
    core = engine.core
    prompts = make_prompts(n, args.prompt_len, engine.model_config.vocab_size, seed=n)
    admit(engine, prompts, args.steps + 8, structured)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.running + list(
            core.scheduler.waiting)):  # fmt: skip
        core.step()
    for _ in range(3):
        core.step()
    clock = MaskClock(engine) if structured is not None else None
    sample_fn, samples = core._sample, []

    def timed_sample(*a):
        start = time.perf_counter()
        try:
            return sample_fn(*a)
        finally:
            samples.append(time.perf_counter() - start)

    core._sample = timed_sample
    steps: list[float] = []
    constraints = []
    try:
        for _ in range(args.steps):
            running = list(core.scheduler.running)
            full = len(running) == n
            start = time.perf_counter()
            core.step()
            elapsed = time.perf_counter() - start
            if clock is not None:
                clock.settle(True)
            if not full:
                samples.pop()
            if full:
                steps.append(elapsed)
                constraints = [r.constraint for r in running]
            elif clock is not None:  # a request finished: its masks do not count either
                for series in (clock.mask_wall, clock.mask_cpu, clock.wait):
                    series.pop()
    finally:
        del core._sample
        if clock is not None:
            clock.restore()
    result = {"step": steps, "sample": samples}
    if clock is not None:
        result.update(mask_wall=clock.mask_wall, mask_cpu=clock.mask_cpu, wait=clock.wait)
        result["fill"] = compare_fills([c for c in constraints if c is not None], args.par_threads)
    while core.has_work():
        core.step()
    return result


def compare_fills(constraints, par_threads: int) -> tuple[float, float, bool]:
    """Serial and parallel bitmask fills of the same matchers (their state unchanged): ms each, and
    whether the masks are identical."""
    import llguidance
    import llguidance.numpy as llnp

    matchers = [c.metered._matcher for c in constraints]  # llguidance's own, inside its MeteredMatcher
    vocab = constraints[0].vocab_size
    executor = llguidance.LLExecutor(par_threads)
    serial_times, par_times, same = [], [], True
    for _ in range(20):  # fresh copies each time: llguidance may keep a state's mask once computed
        first, second = [m.deep_copy() for m in matchers], [m.deep_copy() for m in matchers]
        start = time.perf_counter()
        serial = [np.frombuffer(m.compute_bitmask(), dtype="<i4") for m in first]
        serial_times.append(time.perf_counter() - start)
        bitmask = llnp.allocate_token_bitmask(len(matchers), vocab)
        start = time.perf_counter()
        llnp.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(second)], bitmask)
        par_times.append(time.perf_counter() - start)
        # compute_bitmask's row may hold a word past the vocabulary (llguidance's rounding): not compared
        words = bitmask.shape[1]
        same = same and all(np.array_equal(row[:words], bitmask[i]) for i, row in enumerate(serial))
    return 1e3 * statistics.median(serial_times), 1e3 * statistics.median(par_times), same


def ms(values: list[float]) -> str:
    return f"{1e3 * statistics.median(values):.2f}" if values else "-"


def main() -> None:
    args = parse_args()
    cpu = this_cpu()
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    print(f"CPU: {cpu.model_name} [{cpu.isa_summary}], {args.threads} torch threads, load {' '.join(load)}")
    sizes = [int(s) for s in args.sizes.split(",")]
    model_dir = resolve_model(default_model_file(), "bfloat16")
    args.new_tokens = args.steps + 16
    engine = build_engine(model_dir, args, max(sizes), start=False)
    schema = StructuredOutput("json_schema", json.dumps(SCHEMA))
    torch.set_num_threads(args.threads)
    runs: dict[tuple[str, int], list[dict]] = {}
    try:
        run_arm(engine, 2, args, schema)  # warm: the llguidance tokenizer, the schema's compile
        for repeat in range(args.repeats):
            for n in sizes:
                arms = [("free", None), ("schema", schema)]
                for name, structured in arms if repeat % 2 == 0 else arms[::-1]:
                    runs.setdefault((name, n), []).append(run_arm(engine, n, args, structured))
    finally:
        engine.shutdown()
    print("\n| N | free step (ms) | schema step (ms) | sampling, free / schema (ms) |"
          " masks, helper wall / CPU (ms) | engine waited (ms) | N masks serial / parallel fill (ms) |"
          " same masks |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for n in sizes:
        free = [s for r in runs[("free", n)] for s in r["step"]]
        schema_runs = runs[("schema", n)]

        def pick(key: str, schema_runs: list[dict] = schema_runs) -> list[float]:
            return [v for r in schema_runs for v in r[key]]

        fills = [r["fill"] for r in schema_runs]
        free_sample = [s for r in runs[("free", n)] for s in r["sample"]]
        print(f"| {n} | {ms(free)} ({len(free)}) | {ms(pick('step'))} ({len(pick('step'))}) | "
              f"{ms(free_sample)} / {ms(pick('sample'))} | "
              f"{ms(pick('mask_wall'))} / {ms(pick('mask_cpu'))} | {ms(pick('wait'))} "
              f"(max {1e3 * max(pick('wait'), default=0):.2f}) | "
              f"{statistics.median(f[0] for f in fills):.2f} / "
              f"{statistics.median(f[1] for f in fills):.2f} | "
              f"{all(f[2] for f in fills)} |")  # fmt: skip


if __name__ == "__main__":
    main()
