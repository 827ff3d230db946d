"""How far a static-shape backend's buckets must reach, and how far they may: what a step holds.

A bucket smaller than the limits leaves steps the scheduler makes without a shape; one larger than
any step is padding alone, yet its graph is compiled (or its shape warmed) and its tensors allocated
all the same: --seq-buckets 4,1000000 beside --max-num-seqs 4 asked for 32.9 GB at an XLA warmup, and
failed naming no flag. Both are the flag's error, said before the decoder listens.
"""

from __future__ import annotations

from tandem.client.errors import ConfigError
from tandem.decoder.config import MAX_SPECULATIVE_TOKENS, EngineConfig


def rows(config: EngineConfig) -> str:
    """What bounds a decode step's rows, as a refusal says it (EngineConfig.max_rows_without_prompt)."""
    return (
        f"the rows a decode step holds: max_num_seqs {config.max_num_seqs} requests, or "
        f"speculative_max_batch {config.speculative_max_batch} each verifying {MAX_SPECULATIVE_TOKENS} "
        "proposals"
    )


def check_reach(name: str, buckets: tuple[int, ...], need: int, what: str) -> None:
    """Refuses buckets whose largest holds less than `need`. Raises ConfigError naming `name`."""
    if buckets[-1] < need:
        raise ConfigError(name, f": the largest must hold {what} ({need:,}), got {buckets[-1]:,}")


def check_most(name: str, buckets: tuple[int, ...], most: int, what: str) -> None:
    """Refuses buckets whose largest is past `most`, what a step can fill. Raises ConfigError."""
    if buckets[-1] > most:
        raise ConfigError(name, f"must be at most {most:,} ({what}), got {buckets[-1]:,}")
