"""LoRA's cost per step on the CPU executor: a prefill of N x 128 tokens and an N-row decode step of
SmolLM2-135M-Instruct in bf16, without LoRA, with 4 adapters loaded and base rows, and with the rows
on the 4 adapters mixed (row i's request on adapter i % 4; rank 16 on all seven projections).

Why beside bench/lora_throughput.py: that one measures the engine end to end in wall time, which on a
shared machine moves with the neighbours' load by 2x and more. This one times the executor's own
calls on one thread in that thread's CPU time (`time.thread_time`: a preempted thread's wait is not
counted), interleaved and the median of `--repeats`, so the ratios hold on a loaded machine (caches
shared with the neighbours still slow both arms). `--threads 2` times wall clock instead.

Run: `.venv/bin/python bench/lora_steps.py` (about 2 minutes); prints one line per arm and N, and
the CPU with its flags.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.lora_throughput import NUM_ADAPTERS, RANK, write_adapter  # noqa: E402
from tandem.common.torch_part.model_cache import resolve_model  # noqa: E402
from tandem.decoder.backends.cpu.executor import CpuExecutor  # noqa: E402
from tandem.decoder.backends.cpu.isa import this_cpu  # noqa: E402
from tandem.decoder.backends.cpu.kernels import load_for_cpu  # noqa: E402
from tandem.decoder.models.attention import AttentionMetadata  # noqa: E402
from tandem.decoder.models.forward_batch import ForwardBatch  # noqa: E402
from tandem.decoder.models.loader import load_model  # noqa: E402
from tandem.decoder.models.lora import LoraStep, LoraTable  # noqa: E402
from tandem.decoder.models.peft_adapter import read_adapter  # noqa: E402

PROMPT_LEN, BLOCK_SIZE, DECODE_STEPS = 128, 16, 10


def metadata(n: int, query_len: int, start: int) -> AttentionMetadata:
    """n sequences, sequence i in blocks [i * per, (i + 1) * per) (block 0 unused), query_len new
    positions each from `start`; logits at each sequence's last position."""
    per = -(-(PROMPT_LEN + 1) // BLOCK_SIZE)
    seq_len = start + query_len
    slots = [(1 + i * per) * BLOCK_SIZE + p for i in range(n) for p in range(start, seq_len)]
    tables = torch.tensor([[1 + i * per + b for b in range(per)] for i in range(n)], dtype=torch.int32)
    return AttentionMetadata(
        query_lens=[query_len] * n,
        seq_lens=[seq_len] * n,
        seq_lens_t=torch.full((n,), seq_len, dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=tables,
        logits_indices=torch.arange(1, n + 1) * query_len - 1,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-seqs", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    loaded = load_model(resolve_model(None, "bfloat16"), dtype="bfloat16")
    model, config = loaded.model, loaded.config
    kernels = load_for_cpu()
    table = LoraTable(config, NUM_ADAPTERS, RANK, torch.device("cpu"))
    with tempfile.TemporaryDirectory() as tmp:
        for slot in range(NUM_ADAPTERS):
            path = write_adapter(Path(tmp) / f"a{slot}", config, seed=slot)
            table.write(slot, read_adapter(path, config, RANK))
    plain, lora = CpuExecutor(model, kernels), CpuExecutor(model, kernels, lora=table)
    cpu = this_cpu()
    print(f"CPU: {cpu.model_name} [{cpu.isa_summary}], {args.threads} thread(s), "
          f"{'CPU' if args.threads == 1 else 'wall'} time; with LoRA: {lora.choice.describe()}")  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    for n in args.num_seqs:
        caches = model.allocate_kv_cache(1 + n * -(-(PROMPT_LEN + 1) // BLOCK_SIZE), BLOCK_SIZE)
        prefill = (
            torch.randint(0, config.vocab_size, (n * PROMPT_LEN,), generator=generator, dtype=torch.int32),
            torch.arange(PROMPT_LEN).repeat(n),
            metadata(n, PROMPT_LEN, 0),
        )
        decode = (
            torch.randint(0, config.vocab_size, (n,), generator=generator, dtype=torch.int32),
            torch.full((n,), PROMPT_LEN),
            metadata(n, 1, PROMPT_LEN),
        )
        mixed = torch.arange(n) % NUM_ADAPTERS  # sequence i on adapter i % 4
        arms = {
            "base": (plain, None, None),
            "base-lora-on": (lora, LoraStep(table, None), LoraStep(table, None)),
            "mixed": (lora, LoraStep(table, mixed.repeat_interleave(PROMPT_LEN)), LoraStep(table, mixed)),
        }
        times: dict[str, dict[str, list[float]]] = {arm: {"prefill": [], "decode": []} for arm in arms}
        with torch.inference_mode():
            for r in range(args.repeats):
                for arm in list(arms)[r % 3 :] + list(arms)[: r % 3]:
                    executor, prefill_lora, decode_lora = arms[arm]
                    start = clock()
                    executor(ForwardBatch(*prefill, lora=prefill_lora), caches)
                    times[arm]["prefill"].append(clock() - start)
                    start = clock()
                    for _ in range(DECODE_STEPS):  # the same step again: its KV rows rewritten
                        executor(ForwardBatch(*decode, lora=decode_lora), caches)
                    times[arm]["decode"].append((clock() - start) / DECODE_STEPS)
        base = {kind: statistics.median(v) for kind, v in times["base"].items()}
        for arm in arms:
            p, d = (statistics.median(times[arm][kind]) for kind in ("prefill", "decode"))
            print(f"N = {n:2d} {arm:12s}: prefill of {n * PROMPT_LEN} tokens {1e3 * p:7.1f} ms "
                  f"({base['prefill'] / p:.2f}x base), decode step {1e3 * d:6.2f} ms "
                  f"({base['decode'] / d:.2f}x base)", flush=True)  # fmt: skip
    print(f"load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
