"""The machine's floors, measured in the run they bound: the shared VM's speed drifts by 2-3x.

Rates measured with torch on the benchmark's own threads, each the best of a few timings:
- memory read bandwidth: `sum` over a 1 GiB fp32 tensor (far larger than the 32 MiB L3);
- matmul rate: 1024 x 1024 x 1024 matmuls in bf16 and in fp32, the faster of the two bounding
  compute. Where oneDNN has a bf16 path (AVX-512) bf16 is the faster; on an AVX2-only CPU torch's
  bf16 matmul is a reference loop and the FMA units' real rate is fp32's (a bf16 kernel widens to
  fp32 and multiplies at that rate at best).
The harness samples them between workloads and bounds with the best sample (the least contended
machine it saw), so that a floor is never below what an engine reached in the same run.

They bound a model of `params` bf16 parameters:
- decode reads every weight once per step and multiplies it once per sequence (2 FLOPs per parameter
  per token; the tied LM head counts; attention over the short KV cache is left out). Weight-bandwidth
  floor at batch N: N x bandwidth / (2 bytes x params) tokens/s; compute floor: matmul rate /
  (2 x params); the floor at batch N is the lower of the two.
- prefill of L tokens needs the linear layers for every token, the LM head for the last only, and
  causal attention (QK^T and PV, half the L x L square): its compute floor is those FLOPs / matmul rate.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

READ_BYTES = 1 << 30
MATMUL_SIZE = 1024


@dataclass(frozen=True)
class ModelCost:
    params: int  # every parameter, a tied embedding counted once
    lm_head_params: int  # vocab_size x hidden_size
    attention_width: int  # num_heads x head_dim
    num_layers: int

    @property
    def weight_bytes(self) -> int:
        return 2 * self.params  # bf16

    def decode_flops_per_token(self) -> float:
        return 2.0 * self.params

    def prefill_flops(self, num_tokens: int) -> float:
        linear = 2.0 * (self.params - self.lm_head_params) * num_tokens + 2.0 * self.lm_head_params
        attention = 2.0 * num_tokens * num_tokens * self.attention_width * self.num_layers
        return linear + attention


@dataclass(frozen=True)
class Floors:
    read_gb_per_s: float  # 1e9 bytes/s
    matmul_bf16_gflops: float  # 1e9 FLOP/s
    matmul_fp32_gflops: float = 0.0  # 1e9 FLOP/s (0: not measured, runs before it existed)

    @property
    def matmul_gflops(self) -> float:
        """The machine's matmul rate: the faster of bf16 and fp32."""
        return max(self.matmul_bf16_gflops, self.matmul_fp32_gflops)

    def as_dict(self) -> dict[str, float]:
        return asdict(self)

    def bandwidth_tok_s(self, cost: ModelCost, num_seqs: int) -> float:
        return num_seqs * self.read_gb_per_s * 1e9 / cost.weight_bytes

    def compute_tok_s(self, cost: ModelCost) -> float:
        return self.matmul_gflops * 1e9 / cost.decode_flops_per_token()

    def decode_tok_s(self, cost: ModelCost, num_seqs: int) -> float:
        return min(self.bandwidth_tok_s(cost, num_seqs), self.compute_tok_s(cost))

    def prefill_s(self, cost: ModelCost, num_tokens: int) -> float:
        return cost.prefill_flops(num_tokens) / (self.matmul_gflops * 1e9)


def _best_time(fn, repeats: int) -> float:
    fn()  # warm-up: page faults, thread pool
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_floors(repeats: int = 5, matmuls_per_timing: int = 10) -> Floors:
    x = torch.ones(READ_BYTES // 4, dtype=torch.float32)  # [256Mi]
    read_s = _best_time(x.sum, repeats)
    del x
    rates = {}
    for dtype in (torch.bfloat16, torch.float32):
        a = torch.randn(MATMUL_SIZE, MATMUL_SIZE).to(dtype)  # [1024, 1024]
        b = torch.randn(MATMUL_SIZE, MATMUL_SIZE).to(dtype)
        # A reference-loop bf16 matmul (AVX2) takes seconds per product: time one, not ten.
        count = matmuls_per_timing if dtype == torch.float32 or _fast(a, b) else 1

        def matmuls(a: torch.Tensor = a, b: torch.Tensor = b, count: int = count) -> None:
            for _ in range(count):
                torch.mm(a, b)

        rates[dtype] = 2 * MATMUL_SIZE**3 * count / _best_time(matmuls, repeats) / 1e9
    return Floors(
        read_gb_per_s=READ_BYTES / read_s / 1e9,
        matmul_bf16_gflops=rates[torch.bfloat16],
        matmul_fp32_gflops=rates[torch.float32],
    )


def _fast(a: torch.Tensor, b: torch.Tensor) -> bool:
    start = time.perf_counter()
    torch.mm(a, b)
    return time.perf_counter() - start < 0.1


def best(samples: list[Floors]) -> Floors:
    """The fastest machine seen across the run's samples, rate by rate."""
    return Floors(
        read_gb_per_s=max(s.read_gb_per_s for s in samples),
        matmul_bf16_gflops=max(s.matmul_bf16_gflops for s in samples),
        matmul_fp32_gflops=max(s.matmul_fp32_gflops for s in samples),
    )


if __name__ == "__main__":
    torch.set_num_threads(2)
    print(measure_floors())
