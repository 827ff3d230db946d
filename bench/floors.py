"""The machine's floors, measured in the run they bound: the shared VM's speed drifts by 2-3x.

Two rates, measured with torch on the benchmark's own threads, each the best of a few timings:
- memory read bandwidth: `sum` over a 1 GiB fp32 tensor (far larger than the 32 MiB L3);
- bf16 matmul rate: 1024 x 1024 x 1024 matmuls.
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

    def as_dict(self) -> dict[str, float]:
        return asdict(self)

    def bandwidth_tok_s(self, cost: ModelCost, num_seqs: int) -> float:
        return num_seqs * self.read_gb_per_s * 1e9 / cost.weight_bytes

    def compute_tok_s(self, cost: ModelCost) -> float:
        return self.matmul_bf16_gflops * 1e9 / cost.decode_flops_per_token()

    def decode_tok_s(self, cost: ModelCost, num_seqs: int) -> float:
        return min(self.bandwidth_tok_s(cost, num_seqs), self.compute_tok_s(cost))

    def prefill_s(self, cost: ModelCost, num_tokens: int) -> float:
        return cost.prefill_flops(num_tokens) / (self.matmul_bf16_gflops * 1e9)


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
    a = torch.randn(MATMUL_SIZE, MATMUL_SIZE).to(torch.bfloat16)  # [1024, 1024]
    b = torch.randn(MATMUL_SIZE, MATMUL_SIZE).to(torch.bfloat16)

    def matmuls() -> None:
        for _ in range(matmuls_per_timing):
            torch.mm(a, b)

    matmul_s = _best_time(matmuls, repeats)
    flops = 2 * MATMUL_SIZE**3 * matmuls_per_timing
    return Floors(read_gb_per_s=READ_BYTES / read_s / 1e9, matmul_bf16_gflops=flops / matmul_s / 1e9)


def best(samples: list[Floors]) -> Floors:
    """The fastest machine seen across the run's samples, rate by rate."""
    return Floors(
        read_gb_per_s=max(s.read_gb_per_s for s in samples),
        matmul_bf16_gflops=max(s.matmul_bf16_gflops for s in samples),
    )


if __name__ == "__main__":
    torch.set_num_threads(2)
    print(measure_floors())
