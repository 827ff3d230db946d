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
        f"the rows a decode step holds: --max-num-seqs {config.max_num_seqs} requests, or "
        f"--speculative-max-batch {config.speculative_max_batch} each verifying {MAX_SPECULATIVE_TOKENS} "
        "proposals"
    )


def check_widths(config: EngineConfig, widths: tuple[int, ...], served_len: int, configured_len: int) -> None:
    """Refuses block-table widths (--block-table-buckets) that cannot hold a sequence of the context
    served, `served_len` positions, or that reach past the blocks of the context configured,
    `configured_len` (--max-model-len, or the checkpoint's), before the KV pool capped it.

    Why the configured context bounds them: a width past the pool's cap ran before the cap was
    checked (its tables padded with the null block), so it is refused only past what this
    configuration could ever serve; and a refusal names the context the user gave, not one the pool
    made (--max-model-len 80 --block-table-buckets 5 with a 4-block pool said "max_model_len 48")."""
    block_size = config.block_size
    configured_len = max(configured_len, served_len)
    configured = _context(config, configured_len)
    served = configured
    if served_len < configured_len:
        served = f"the {served_len:,} positions the KV pool holds for one sequence (below {configured})"
    each = f" at --block-size {block_size}"
    check_reach("block_table_buckets", widths, -(-served_len // block_size), f"the blocks of {served}{each}")
    check_most(
        "block_table_buckets", widths, -(-configured_len // block_size), f"the blocks of {configured}{each}"
    )


def _context(config: EngineConfig, max_model_len: int) -> str:
    """A context length as the user gave it: the flag, or (its default) the length alone."""
    if config.max_model_len == max_model_len:
        return f"--max-model-len {max_model_len:,}"
    return f"a {max_model_len:,}-position context"


def check_reach(name: str, buckets: tuple[int, ...], need: int, what: str) -> None:
    """Refuses buckets whose largest holds less than `need`. Raises ConfigError naming `name`."""
    if buckets[-1] < need:
        raise ConfigError(name, f": the largest must hold {what} ({need:,}), got {buckets[-1]:,}")


def check_most(name: str, buckets: tuple[int, ...], most: int, what: str) -> None:
    """Refuses buckets whose largest is past `most`, what a step can fill. Raises ConfigError."""
    if buckets[-1] > most:
        raise ConfigError(name, f"must be at most {most:,} ({what}), got {buckets[-1]:,}")
