"""How the engine wants its CPU kernels chosen (`--cpu-kernels`, the row counts a step calls the linears
with, the cache's directory): what `kernel_choice.choose` and `int8_tile_choice.int8_tiles` read."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

AUTO = "auto"
TILES = "amx"  # the amx build's AMX tiles; the amx build also runs "avx512bf16" (VDPBF16PS)
# --cpu-kernels: auto, or one build's kernel for every call (the builds of every architecture).
CPU_KERNELS = (AUTO, "x86_64", "avx2", "avx512", "avx512bf16", TILES, "aarch64", "generic")


@dataclass(frozen=True)
class KernelOptions:
    """How the engine wants its CPU kernels chosen; built from EngineConfig (`kernel_options`)."""

    kernels: str = AUTO  # --cpu-kernels: "auto" (measured) or a build's name
    exact_rows: int = 64  # the most rows a step without prompt positions holds (decode, verify)
    max_rows: int = 2048  # the step's token budget: the largest prefill chunk
    prefill_kernels: bool = True  # may prefill chunks take a kernel of their own (not --batch-invariant)
    cache_dir: Path | None = None  # where the measured choice is cached (the model's directory); None: not
    # Quantized linears: each decode or verify row's inputs rounded to int8 (--quantized-activations)
    int8_activations: bool = False

    @property
    def prefill_rows(self) -> int:
        """Calls of this many rows on are prefill chunks (every step without prompt rows is smaller)."""
        return self.exact_rows + 1

    @property
    def exact_buckets(self) -> tuple[int, ...]:
        """The row counts the exact kernels are timed at: one row, 4, 16, and the largest step without
        prompt rows up to 32 (past it the kernels' time per row no longer changes, and the LM head's
        calls would take most of the measurement)."""
        top = min(self.exact_rows, 32)
        return tuple(sorted({1, *(r for r in (4, 16) if r < top), top}))

    @property
    def prefill_buckets(self) -> tuple[int, ...]:
        """The prefill chunk sizes timed: just past the exact rows (128 at least), and a long chunk
        (512, or the budget)."""
        if not self.prefill_kernels or self.max_rows < self.prefill_rows:
            return ()
        short = max(self.prefill_rows, 128)
        return tuple(sorted({min(short, self.max_rows), min(max(short, 512), self.max_rows)}))

    @property
    def int8_buckets(self) -> tuple[int, ...]:
        """The row counts the int8 kernels are timed at: the exact buckets and the prefill chunks',
        these whether or not prefill chunks may take a kernel of their own (both int8 kernels are
        exact)."""
        short = max(self.prefill_rows, 128)
        chunks = {min(short, self.max_rows), min(max(short, 512), self.max_rows)}
        return tuple(sorted({*self.exact_buckets, *(c for c in chunks if c > self.exact_rows)}))
