"""Speculative decoding (prompt lookup) on the default model: tokens/s with and without, acceptance.

One engine (SmolLM2-135M-Instruct, bf16, 2 threads, prefix caching off so repeats recompute their
prompts); speculation is switched per request (`GenerateSpec.speculative_tokens`), so both arms run
on the same engine, interleaved, the order alternating per repeat; the median of `--repeats` runs.

Workloads, each at N = 1 (the prompts one after another) and N = 8 (eight at once):
- repetitive: chat requests that repeat a passage of three sentences, or correct the spelling of one
  (the answer copies most of it); greedy, up to 160 new tokens, ending at the model's end of turn;
- paragraphs: the same two tasks on paragraphs of eight sentences (bench/passages.py), up to 400
  new tokens: a rewritten document, where the answer is as long as the passage;
- random: `make bench`'s decode workload, 128 random prompt tokens and 64 greedy tokens (EOS ignored).

Reported per workload and N: tokens/s of each arm and their ratio, the acceptance rate (accepted /
proposed tokens), tokens per engine step, and whether the two arms' tokens are equal.

Run: `.venv/bin/python bench/speculation.py` (about 12 minutes on 2 quiet cores); `--out DIR` writes
speculation-<date>.json there (default bench/results).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.decode_throughput import make_prompts  # noqa: E402
from bench.passages import PARAGRAPHS, PASSAGES  # noqa: E402
from tandem.common.torch_part.model_cache import resolve_model  # noqa: E402
from tandem.decoder.config import EngineConfig  # noqa: E402
from tandem.decoder.engine.admission.chat import ChatMessage, ChatRequest  # noqa: E402
from tandem.decoder.engine.admission.prompt import GenerateSpec, TextPrompt  # noqa: E402
from tandem.decoder.engine.front.engine import Engine  # noqa: E402
from tandem.decoder.engine.outputs.outputs import Delta, Event, Failed, Finished, OutputOptions  # noqa: E402
from tandem.decoder.engine.params import SamplingParams, StoppingParams  # noqa: E402

# Spelling mistakes for the correction task: the answer copies the passage with them fixed.
TYPOS = {"the ": "teh ", "and ": "adn ", "with ": "wiht ", "which ": "wich "}
# A verification step of 4 rows is one 4-row tile of the bf16 kernel: it costs about a plain step.
SPECULATIVE_TOKENS = 3


def repetitive_specs(passages: list[str], max_new_tokens: int) -> list[GenerateSpec]:
    specs = []
    for i, passage in enumerate(passages):
        if i % 2 == 0:
            text = "Repeat the following text exactly, word for word:\n\n" + passage
        else:
            for right, wrong in TYPOS.items():
                passage = passage.replace(right, wrong)
            text = "Correct the spelling mistakes in the following text:\n\n" + passage
        chat = ChatRequest(messages=[ChatMessage("user", [TextPrompt(text)])])
        specs.append(
            GenerateSpec(
                prompt=[],
                chat=chat,
                sampling=SamplingParams(temperature=0.0),
                stopping=StoppingParams(max_new_tokens=max_new_tokens),
                output=OutputOptions(include_text=False),
            )
        )
    return specs


def random_specs(vocab_size: int) -> list[GenerateSpec]:
    return [
        GenerateSpec(
            prompt=[ids],
            sampling=SamplingParams(temperature=0.0),
            stopping=StoppingParams(max_new_tokens=64, ignore_eos=True),
            output=OutputOptions(include_text=False),
        )
        for ids in make_prompts(8, 128, vocab_size, seed=0)
    ]


def run(engine: Engine, specs: list[GenerateSpec], concurrency: int, speculative_tokens: int) -> dict:
    """`specs` in waves of `concurrency` requests; totals over all of them.

    Decoding time is each wave's time from its last first token to its last token: the prompts'
    prefill, the same in both arms, is left out of the decode-only rate."""
    tokens: list[list[int]] = [[] for _ in specs]
    finished: list[Finished] = []
    ends: list[float] = [0.0] * len(specs)
    submitted: list[float] = [0.0] * len(specs)
    steps_before = engine.core.num_steps
    decode_s = 0.0
    start = time.perf_counter()
    for wave in range(0, len(specs), concurrency):
        done = threading.Semaphore(0)
        wave_finished: list[tuple[int, Finished]] = []
        for i in range(wave, min(wave + concurrency, len(specs))):

            def sink(
                event: Event, i: int = i, done: threading.Semaphore = done, mine: list = wave_finished
            ) -> None:
                if isinstance(event, Delta):
                    tokens[i].extend(event.token_ids)
                elif isinstance(event, Finished):
                    ends[i] = time.perf_counter()
                    finished.append(event)
                    mine.append((i, event))
                    done.release()
                elif isinstance(event, Failed):
                    raise SystemExit(f"request {i} failed: {event.error}")

            spec = specs[i]
            submitted[i] = time.perf_counter()
            engine.submit(
                GenerateSpec(
                    spec.prompt,
                    spec.sampling,
                    spec.stopping,
                    spec.output,
                    chat=spec.chat,
                    speculative_tokens=speculative_tokens,
                ),
                sink,
            )
        for _ in range(wave, min(wave + concurrency, len(specs))):
            if not done.acquire(timeout=600):
                raise SystemExit("a request did not finish within 600 s")
        last_first = max(submitted[i] + f.time_to_first_token_s for i, f in wave_finished)
        decode_s += max(ends[i] for i, _ in wave_finished) - last_first
    wall = time.perf_counter() - start
    generated = sum(f.output_tokens for f in finished)
    proposed = sum(f.proposed_tokens for f in finished)
    accepted = sum(f.accepted_tokens for f in finished)
    return {
        "tokens_per_s": generated / wall,
        "decode_tokens_per_s": (generated - len(specs)) / decode_s,
        "wall_s": wall,
        "tokens": generated,
        "steps": engine.core.num_steps - steps_before,
        "proposed": proposed,
        "accepted": accepted,
        "outputs": tokens,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--k", type=int, default=SPECULATIVE_TOKENS, help="speculative_tokens of the arm")
    parser.add_argument("--sizes", default="1,8", help="concurrencies, comma-separated")
    parser.add_argument("--workloads", default="repetitive,paragraphs,random", help="comma-separated")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    known = ("repetitive", "paragraphs", "random")
    unknown = sorted(set(args.workloads.split(",")) - set(known))
    if unknown:
        parser.error(f"--workloads: unknown {', '.join(unknown)}; known: {', '.join(known)}")

    model_dir = resolve_model(None, "bfloat16")
    config = EngineConfig(
        model_dir=model_dir,
        dtype="bfloat16",
        max_num_seqs=32,
        enable_prefix_caching=False,
        num_threads=args.threads,
    )
    rows = []
    with Engine(config) as engine:
        every = {
            "repetitive": repetitive_specs(PASSAGES, 160),
            "paragraphs": repetitive_specs(PARAGRAPHS, 400),
            "random": random_specs(engine.model_config.vocab_size),
        }
        workloads = {name: every[name] for name in args.workloads.split(",")}
        for specs in workloads.values():  # warm up both arms on every shape
            run(engine, specs[:2], 2, 0)
            run(engine, specs[:2], 2, args.k)
        for name, specs in workloads.items():
            for concurrency in [int(n) for n in args.sizes.split(",")]:
                arms: dict[int, list[dict]] = {0: [], args.k: []}
                for repeat in range(args.repeats):
                    order = [0, args.k] if repeat % 2 == 0 else [args.k, 0]
                    for k in order:
                        arms[k].append(run(engine, specs, concurrency, k))
                plain, spec = arms[0], arms[args.k]
                plain_rate = statistics.median(r["tokens_per_s"] for r in plain)
                spec_rate = statistics.median(r["tokens_per_s"] for r in spec)
                plain_decode = statistics.median(r["decode_tokens_per_s"] for r in plain)
                spec_decode = statistics.median(r["decode_tokens_per_s"] for r in spec)
                row = {
                    "workload": name,
                    "concurrency": concurrency,
                    "plain_tokens_per_s": plain_rate,
                    "speculative_tokens_per_s": spec_rate,
                    "ratio": spec_rate / plain_rate,
                    "plain_decode_tokens_per_s": plain_decode,
                    "speculative_decode_tokens_per_s": spec_decode,
                    "decode_ratio": spec_decode / plain_decode,
                    "acceptance": spec[0]["accepted"] / max(1, spec[0]["proposed"]),
                    "proposed": spec[0]["proposed"],
                    "accepted": spec[0]["accepted"],
                    "tokens": spec[0]["tokens"],
                    "tokens_per_step_plain": plain[0]["tokens"] / plain[0]["steps"],
                    "tokens_per_step_speculative": spec[0]["tokens"] / spec[0]["steps"],
                    "same_tokens": all(r["outputs"] == plain[0]["outputs"] for r in plain + spec),
                    "runs": {
                        "plain": [r["tokens_per_s"] for r in plain],
                        "speculative": [r["tokens_per_s"] for r in spec],
                    },
                }
                rows.append(row)
                print(
                    f"{name:10s} N={concurrency}: plain {plain_rate:6.1f} tok/s, speculative "
                    f"{spec_rate:6.1f} tok/s ({row['ratio']:.2f}x; decoding {plain_decode:.1f} -> "
                    f"{spec_decode:.1f}, {row['decode_ratio']:.2f}x), acceptance {row['acceptance']:.0%} "
                    f"({row['accepted']}/{row['proposed']}), tokens/step "
                    f"{row['tokens_per_step_plain']:.2f} -> {row['tokens_per_step_speculative']:.2f}, "
                    f"same tokens: {row['same_tokens']}",
                    flush=True,
                )
    print()
    print(
        f"| workload | N | without | with (k = {args.k}) | ratio | decoding: without | with | ratio ", end=""
    )
    print("| acceptance | tokens per step | same tokens |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['workload']} | {r['concurrency']} | {r['plain_tokens_per_s']:.1f} | "
            f"{r['speculative_tokens_per_s']:.1f} | {r['ratio']:.2f}x | "
            f"{r['plain_decode_tokens_per_s']:.1f} | {r['speculative_decode_tokens_per_s']:.1f} | "
            f"{r['decode_ratio']:.2f}x | {r['acceptance']:.0%} | "
            f"{r['tokens_per_step_plain']:.2f} -> {r['tokens_per_step_speculative']:.2f} | "
            f"{r['same_tokens']} |"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    default_workloads = args.workloads == parser.get_default("workloads")
    default = args.k == SPECULATIVE_TOKENS and args.sizes == "1,8" and default_workloads
    suffix = "" if default else f"-k{args.k}-n{args.sizes}-{args.workloads.replace(',', '-')}"
    path = args.out / f"speculation-{datetime.date.today().isoformat()}{suffix}.json"
    settings = {
        "model": str(model_dir),
        "threads": args.threads,
        "repeats": args.repeats,
        "k": args.k,
    }
    path.write_text(json.dumps({"settings": settings, "rows": rows}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
