"""Sequence-parallel prefill: one 4,096-token prompt on bench-small, 2 ranks x 1 thread against 1 rank.

Runs, in one invocation and in this order: 1 rank x 1 thread and 1 rank x 2 threads (in this
process), then 2 gloo ranks x 1 thread each (spawned). Each configuration runs the same single-step
prefill through `ModelRunner.forward` (one sequence, fresh KV blocks every repeat): one warm-up, then
the median of --repeats. Also reported: what every collective moved during one 2-rank prefill, as
the bytes of the whole tensor each call reduces or gathers, per prompt token, by collective.

    .venv/bin/python bench/sp_prefill.py                        # defaults: 4096 tokens, bf16, 3 repeats
    .venv/bin/python bench/sp_prefill.py --tokens 512 --repeats 1   # smoke
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tandem.common.torch_part.random_model import make_model  # noqa: E402
from tandem.decoder.distributed.parallel import ParallelContext, RankInfo, free_port, init_parallel  # noqa: E402
from tandem.decoder.engine.step.batch import StepBatch  # noqa: E402
from tandem.decoder.engine.step.runner import ModelRunner  # noqa: E402
from tandem.decoder.models.attention import AttentionMetadata  # noqa: E402
from tandem.decoder.models.forward_batch import ForwardBatch  # noqa: E402
from tandem.decoder.models.loader import load_model  # noqa: E402

BLOCK_SIZE = 16


class CountingContext(ParallelContext):
    """The rank's context, recording the bytes of every collective's full tensor."""

    def __init__(self, tp: ParallelContext) -> None:
        super().__init__(tp.rank, tp.world_size, tp.group, tp.control, tp.timeout_s)
        self.bytes: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)

    def _count(self, name: str, tensor: torch.Tensor) -> None:
        self.bytes[name] += tensor.numel() * tensor.element_size()
        self.calls[name] += 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self._count("all_reduce", x)
        return super().all_reduce(x)

    def all_gather_seq(self, x: torch.Tensor) -> torch.Tensor:
        out = super().all_gather_seq(x)
        self._count("all_gather(seq)", out)
        return out

    def reduce_scatter_seq(self, x: torch.Tensor) -> torch.Tensor:
        self._count("reduce_scatter(seq)", x)
        return super().reduce_scatter_seq(x)

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        self._count("all_gather(vocab)", x.new_empty(*x.shape[:-1], x.shape[-1] * self.world_size))
        stacked = ParallelContext.all_gather_seq(self, x).view(self.world_size, *x.shape)
        return torch.cat(stacked.unbind(0), dim=-1)


def prefill_batch(num_tokens: int, vocab_size: int) -> StepBatch:
    """One sequence of `num_tokens` random token IDs in blocks 1, 2, ... (block 0 is the null block)."""
    gen = torch.Generator().manual_seed(0)
    num_blocks = -(-num_tokens // BLOCK_SIZE)
    attn = AttentionMetadata(
        query_lens=[num_tokens],
        seq_lens=[num_tokens],
        seq_lens_t=torch.tensor([num_tokens], dtype=torch.int32),
        slot_mapping=torch.arange(BLOCK_SIZE, BLOCK_SIZE + num_tokens, dtype=torch.int64),
        block_tables=torch.arange(1, num_blocks + 1, dtype=torch.int32)[None, :],
        logits_indices=torch.tensor([num_tokens - 1]),
    )
    ids = torch.randint(0, vocab_size, (num_tokens,), generator=gen, dtype=torch.int32)
    return StepBatch(ForwardBatch(ids, torch.arange(num_tokens), attn), num_logits=1)


def time_prefill(model, num_tokens: int, repeats: int, tp: ParallelContext | None = None) -> list[float]:
    runner = ModelRunner(model, num_blocks=-(-num_tokens // BLOCK_SIZE) + 1, block_size=BLOCK_SIZE)
    batch = prefill_batch(num_tokens, model.config.vocab_size)
    times = []
    with torch.inference_mode():
        for _ in range(repeats + 1):  # the first is the warm-up
            if tp is not None:
                ParallelContext.all_reduce(tp, torch.zeros(1))  # start together (not counted)
            start = time.perf_counter()
            runner.forward(batch)
            times.append(time.perf_counter() - start)
    return times[1:]


def _rank_main(info: RankInfo, args: argparse.Namespace, results: multiprocessing.Queue) -> None:
    torch.set_num_threads(1)
    tp = CountingContext(init_parallel(info, "cpu", timeout_s=600))
    model = load_model(args.model_dir, args.dtype, tp=tp).model
    times = time_prefill(model, args.tokens, args.repeats, tp)
    calls_per_prefill = {name: n // (args.repeats + 1) for name, n in tp.calls.items()}
    bytes_per_prefill = {name: b // (args.repeats + 1) for name, b in tp.bytes.items()}
    results.put((info.rank, times, calls_per_prefill, bytes_per_prefill))


def run_two_ranks(args: argparse.Namespace) -> tuple[list[float], dict[str, int], dict[str, int]]:
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [
        context.Process(target=_rank_main, args=(RankInfo.local(rank, 2, port), args, results))
        for rank in range(2)
    ]
    for process in processes:
        process.start()
    outcomes = sorted(results.get(timeout=1800) for _ in processes)
    for process in processes:
        process.join()
    _, times, calls, moved = outcomes[0]
    return times, calls, moved


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model-dir", type=Path, default=Path.home() / ".cache" / "tandem" / "models" / "bench-small"
    )
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    if not (args.model_dir / "config.json").exists():
        print(f"writing bench-small to {args.model_dir}", flush=True)
        make_model(args.model_dir, shape="bench-small")

    medians = {}
    model = load_model(args.model_dir, args.dtype).model
    for threads in (1, 2):
        torch.set_num_threads(threads)
        times = time_prefill(model, args.tokens, args.repeats)
        medians[f"1 rank x {threads} thread(s)"] = statistics.median(times)
        print(f"1 rank x {threads} thread(s): {[f'{t:.2f}' for t in times]} s", flush=True)
    del model
    times, calls, moved = run_two_ranks(args)
    medians["2 ranks x 1 thread"] = statistics.median(times)
    print(f"2 ranks x 1 thread: {[f'{t:.2f}' for t in times]} s", flush=True)

    print(f"\nprefill of {args.tokens} tokens, bench-small, {args.dtype}, median of {args.repeats}")
    base = medians["1 rank x 1 thread(s)"]
    for name, seconds in medians.items():
        rate = args.tokens / seconds
        print(f"  {name:<24} {seconds:7.2f} s  {rate:8.0f} tok/s  speedup x{base / seconds:.2f}")
    two_threads, two_ranks = medians["1 rank x 2 thread(s)"], medians["2 ranks x 1 thread"]
    print(f"  2 ranks x 1 thread vs 1 rank x 2 threads: x{two_threads / two_ranks:.2f}")
    print("\ncollectives of one 2-rank prefill (bytes of the full tensor per call; per prompt token):")
    for name in sorted(moved):
        print(f"  {name:<22} {calls[name]:4d} calls  {moved[name] / args.tokens:10.1f} B/token")
    print(
        f"  {'total':<22} {sum(calls.values()):4d} calls  {sum(moved.values()) / args.tokens:10.1f} B/token"
    )


if __name__ == "__main__":
    main()
