"""Quantized linears side by side: Tandem's C kernels (backends/cpu/csrc/linear_quant.c) against the
weight-only kernels torch ships (`aten._weight_int8pack_mm`, `aten._weight_int4pack_mm_for_cpu`, which
torchao builds on), and the dense bf16 linear, at 1, 4, 8 and 32 rows, on SmolLM2-135M's shapes.

One "step" is the 30 layers' qkv, o, gate_up and down linears plus the LM head, bf16 activations, the
weights random (the kernels' speed does not depend on the values). Each kernel's figure is the median
of interleaved repeats. Beside the speed, whether a row's result depends on how many rows run with it
(bitwise: row 0 alone against row 0 of 32): speculative decoding's exactness needs it not to.

    .venv/bin/python bench/quantized_kernels.py [--rows 1,4,8,32] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from tandem.common.torch_part.quantized_tensor import BLOCK, quantize
from tandem.decoder.backends.cpu.isa import this_cpu
from tandem.decoder.backends.cpu.kernels import Kernels, load_for_cpu
from tandem.decoder.backends.cpu.linear import CLinear, QuantLinear

# SmolLM2-135M: hidden 576, 9 heads x 64, 3 KV heads, intermediate 1536, 30 layers, vocab 49152.
LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in): qkv, o, gate_up, down
HEAD_SHAPE = (49152, 576)
LAYERS = 30

Linear = Callable[[torch.Tensor], torch.Tensor]


def ours(
    kernels: Kernels, w: torch.Tensor, bits: int, per_channel: bool, dense_rows: int = 0, int8: bool = False
) -> Linear:
    q = quantize(w, bits, w.shape[1] if per_channel else BLOCK)
    return QuantLinear(kernels, kernels.quantized_weight(q, dense_rows, int8), None, torch.bfloat16)


def torch_int8(w: torch.Tensor) -> Linear:
    scales = (w.float().abs().amax(dim=1) / 127).clamp(min=1e-8)  # [n], one per output channel
    codes = (w.float() / scales[:, None]).round().clamp(-128, 127).to(torch.int8)
    scales = scales.to(torch.bfloat16)
    return lambda x: torch.ops.aten._weight_int8pack_mm(x, codes, scales)


def torch_int4(w: torch.Tensor, group: int = BLOCK) -> Linear:
    n, k = w.shape
    g = w.float().view(n, k // group, group)
    low, high = g.amin(-1), g.amax(-1)
    scale = ((high - low) / 15).clamp(min=1e-8)
    codes = ((g - low[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32).view(n, k)
    # torch dequantizes (q - 8) * scale + zero: our d q + m with zero = m + 8 d.
    scale_zeros = (
        torch.stack((scale, low + 8 * scale), dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
    )
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, scale_zeros)


def build(kernels: Kernels, names: set[str] | None = None) -> dict[str, list[tuple[Linear, int]]]:
    """Each kernel's linears for one step, in order: (linear, its input width); all kernels, or those
    `names` names."""
    generator = torch.Generator().manual_seed(0)
    # Every layer its own weights, as a model's: a step reads each once, from memory, not from cache.
    shapes = [s for _ in range(LAYERS) for s in LAYER_SHAPES] + [HEAD_SHAPE]
    weights = [(torch.randn(*s, generator=generator) * 0.02).to(torch.bfloat16) for s in shapes]
    makers: dict[str, Callable[[torch.Tensor], Linear]] = {
        "bf16 (C, packed)": lambda w: CLinear(kernels, w, None),
        "tandem 4-bit, 32 per scale": lambda w: ours(kernels, w, 4, False),
        # The prefill path at every row count: each weight dequantized to bf16 into the packed kernel.
        "tandem 4-bit, dequantized to bf16": lambda w: ours(kernels, w, 4, False, dense_rows=1),
        "tandem 8-bit, 32 per scale": lambda w: ours(kernels, w, 8, False),
        # --quantized-activations int8: each row's inputs rounded to int8 per 32, integer products.
        "tandem 4-bit, int8 activations": lambda w: ours(kernels, w, 4, False, int8=True),
        "tandem 8-bit, 32 per scale, int8 activations": lambda w: ours(kernels, w, 8, False, int8=True),
        "tandem 8-bit, per channel": lambda w: ours(kernels, w, 8, True),
        "torch int4pack, 32 per scale": torch_int4,
        "torch int8pack, per channel": torch_int8,
    }
    if names is not None and names - set(makers):
        raise SystemExit(f"--kernel: unknown {sorted(names - set(makers))}; there are {list(makers)}")
    chosen = {name: make for name, make in makers.items() if names is None or name in names}
    return {name: [(make(w), w.shape[1]) for w in weights] for name, make in chosen.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", default="1,4,8,32")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--kernel", action="append", help="a kernel to run, by its row name (repeat; default: all)"
    )
    args = parser.parse_args()
    cpu = this_cpu()
    kernels = load_for_cpu()
    threads = torch.get_num_threads()
    print(f"CPU: {cpu.model_name} ({cpu.isa_summary}); kernel build {kernels.level.name}; {threads} threads")
    kinds = build(kernels, set(args.kernel) if args.kernel else None)
    rows = [int(r) for r in args.rows.split(",")]
    print("\n| step ms | " + " | ".join(map(str, rows)) + " rows | same row alone and in 32 |")
    print("|---|" + "---|" * (len(rows) + 1))
    # Kernels interleaved within each repeat, so a noisy neighbour on a shared machine slows them alike.
    times = {name: {m: [] for m in rows} for name in kinds}
    for _ in range(args.repeats + 1):  # the first is a warm-up
        for name, linears in kinds.items():
            for m in rows:
                times[name][m].append(run_step(linears, m))
    for name, linears in kinds.items():
        medians = [statistics.median(times[name][m][1:]) for m in rows]
        print(f"| {name} | " + " | ".join(f"{t:.2f}" for t in medians) + f" | {row_invariant(linears)} |")


def run_step(linears: list[tuple[Linear, int]], m: int) -> float:
    xs = {k: torch.randn(m, k).to(torch.bfloat16) for k in {576, 1536}}
    start = time.perf_counter()
    for linear, k in linears:
        linear(xs[k])
    return 1e3 * (time.perf_counter() - start)


def row_invariant(linears: list[tuple[Linear, int]]) -> str:
    same = []
    for linear, k in [*linears[: len(LAYER_SHAPES)], linears[-1]]:  # one of each shape
        x = torch.randn(32, k).to(torch.bfloat16)
        same.append(torch.equal(linear(x[:1])[0], linear(x)[0]))
    return "yes" if all(same) else f"no ({sum(not s for s in same)} of {len(same)} shapes differ)"


if __name__ == "__main__":
    main()
