"""LoRA adapters on the default model: decode tokens/s with 4 adapters mixed in one batch against the
base model alone, and the cost of one adapter swap.

Engines (SmolLM2-135M-Instruct, bf16, the production CPU path, prefix caching off): one without
LoRA (the fused C layers and the one-call decode stack), and one with --enable-lora (the same
path, each adapted row's delta added after each projection), holding 4 adapters of rank 16 on all
seven projections (random A and B, written in PEFT's format). Arms, interleaved and rotated per
repeat, the median of `--repeats`:
- base: N requests on the engine without LoRA (what a server that never loads an adapter runs);
- base-lora-on: N base-model requests on the LoRA engine;
- mixed: N requests on the LoRA engine, request i on adapter i % 4.
Each request: `make bench`'s decode workload (128 random prompt tokens, 64 greedy tokens, EOS
ignored); tokens/s = output tokens / wall time, N at once. A swap: LoadAdapter of a fifth adapter
into a slot freed by an unload (files read and checked, slot written), timed end to end.

Run: `.venv/bin/python bench/lora_throughput.py` (about 4 minutes on 2 quiet cores); prints one JSON
line per arm and N (with each repeat's ratio to the base run beside it, and the load average before
and after: on a shared machine the paired ratios are steadier than the medians), and the CPU with
its flags.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.decode_throughput import make_prompts  # noqa: E402
from tandem.common.torch_part.model_cache import resolve_model  # noqa: E402
from tandem.decoder.backends.cpu.isa import this_cpu  # noqa: E402
from tandem.decoder.config import EngineConfig  # noqa: E402
from tandem.decoder.engine.admission.prompt import GenerateSpec  # noqa: E402
from tandem.decoder.engine.front.engine import Engine  # noqa: E402
from tandem.decoder.engine.outputs.outputs import Finished  # noqa: E402
from tandem.decoder.engine.params import SamplingParams, StoppingParams  # noqa: E402
from tandem.decoder.models.config import ModelConfig  # noqa: E402
from tandem.decoder.models.loader import check_checkpoint  # noqa: E402
from tandem.decoder.models.peft_adapter import TARGETS  # noqa: E402
from tandem.decoder.models.peft_weights import module_shapes  # noqa: E402

RANK, NUM_ADAPTERS, NEW_TOKENS = 16, 4, 64


def write_adapter(out: Path, config: ModelConfig, seed: int) -> Path:
    """A PEFT adapter of RANK on every projection of every layer, random A and B (std 0.02)."""
    generator = torch.Generator().manual_seed(seed)
    shapes, tensors = module_shapes(config), {}
    for layer in range(config.num_layers):
        for module in TARGETS:
            out_features, in_features = shapes[module]
            kind = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            name = f"base_model.model.model.layers.{layer}.{kind}.{module}.lora_{{}}.weight"
            tensors[name.format("A")] = torch.randn(RANK, in_features, generator=generator) * 0.02
            tensors[name.format("B")] = torch.randn(out_features, RANK, generator=generator) * 0.02
    out.mkdir(parents=True)
    settings = {"peft_type": "LORA", "r": RANK, "lora_alpha": 2 * RANK, "target_modules": list(TARGETS)}
    (out / "adapter_config.json").write_text(json.dumps(settings))
    save_file(tensors, out / "adapter_model.safetensors")
    return out


def run(engine: Engine, prompts: list[list[int]], adapters: list[str]) -> float:
    """Output tokens/s of the prompts run at once, request i on adapters[i % len(adapters)]."""
    specs = [
        GenerateSpec(
            prompt=[p],
            sampling=SamplingParams(temperature=0.0),
            stopping=StoppingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True),
            adapter=adapters[i % len(adapters)],
        )
        for i, p in enumerate(prompts)
    ]
    counts = [0] * len(specs)

    def one(i: int) -> None:
        for event in engine.generate(specs[i]):
            if isinstance(event, Finished):
                counts[i] = event.output_tokens

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(specs))]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-seqs", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    model_dir = resolve_model(None, "bfloat16")
    config = check_checkpoint(model_dir, "bfloat16")
    cpu = this_cpu()
    print(f"CPU: {cpu.model_name} [{cpu.isa_summary}], {args.threads} threads", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        paths = [write_adapter(Path(tmp) / f"a{i}", config, seed=i) for i in range(NUM_ADAPTERS + 1)]
        common = dict(
            model_dir=model_dir, dtype="bfloat16", enable_prefix_caching=False, num_threads=args.threads,
            max_num_seqs=max(args.num_seqs),
        )  # fmt: skip
        plain = Engine(EngineConfig(**common)).start()
        lora = Engine(
            EngineConfig(
                **common,
                enable_lora=True,
                max_loras=NUM_ADAPTERS,
                max_lora_rank=RANK,
                loras=tuple((f"a{i}", paths[i]) for i in range(NUM_ADAPTERS)),
            )
        ).start()
        names = [f"a{i}" for i in range(NUM_ADAPTERS)]
        arms = {"base": (plain, [""]), "base-lora-on": (lora, [""]), "mixed": (lora, names)}
        for n in args.num_seqs:
            prompts = make_prompts(n, 128, config.vocab_size, seed=n)
            run(plain, prompts[:2], [""]), run(lora, prompts[:2], names)  # warm both
            results: dict[str, list[float]] = {arm: [] for arm in arms}
            order = list(arms)
            load_before = os.getloadavg()[0]
            for r in range(args.repeats):
                for arm in order[r % 3 :] + order[: r % 3]:
                    engine, adapters = arms[arm]
                    results[arm].append(run(engine, prompts, adapters))
            medians = {arm: statistics.median(v) for arm, v in results.items()}
            load = [round(load_before, 2), round(os.getloadavg()[0], 2)]
            for arm, value in medians.items():
                paired = zip(results[arm], results["base"], strict=True)
                line = {
                    "n": n,
                    "arm": arm,
                    "tokens_per_s": round(value, 1),
                    "runs": [round(v, 1) for v in results[arm]],
                    "vs_base": round(value / medians["base"], 3),
                    "vs_base_runs": [round(v / b, 3) for v, b in paired],
                    "load": load,
                }
                print(json.dumps(line), flush=True)
        swaps = []
        for _ in range(args.repeats):
            lora.unload_adapter("a0")
            start = time.perf_counter()
            asyncio.run(lora.load_adapter("a0", str(paths[NUM_ADAPTERS])))
            swaps.append(time.perf_counter() - start)
            lora.unload_adapter("a0")
            asyncio.run(lora.load_adapter("a0", str(paths[0])))
        print(
            json.dumps(
                {
                    "swap_ms": round(1000 * statistics.median(swaps), 1),
                    "runs_ms": [round(1000 * s, 1) for s in swaps],
                }
            )
        )
        plain.shutdown()
        lora.shutdown()


if __name__ == "__main__":
    main()
