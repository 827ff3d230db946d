"""The XLA backend's static shapes: the buckets every step is padded to, each compiled once at warmup.

Two kinds of graph, as NxD Inference separates them: token generation (decode: one query per row,
`num_seqs` rows) and context encoding (prefill: one sequence's chunk of `num_tokens` positions; the
runner runs each prefill chunk as a graph of its own). Both come in block-table widths, since
attention costs what the width holds. A prefill bucket of `num_tokens` positions exists only at the
widths a chunk that pads to it can have: a chunk longer than the next smaller bucket spans more
than that many positions, so narrower tables never pair with it.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

from tandem.client.errors import ConfigError
from tandem.decoder.config import EngineConfig
from tandem.decoder.engine.step.bucket_bounds import check_most, check_reach, check_widths, rows
from tandem.decoder.engine.step.static_shapes import power_of_two_buckets

MIN_PREFILL_TOKENS = 16  # the smallest prefill bucket (before rounding to the device count)
MIN_WIDTH = 4  # blocks of the narrowest block table: narrower saves little and costs graphs


@dataclass(frozen=True)
class Bucket:
    """One compiled graph's shape."""

    num_tokens: int  # padded positions
    num_seqs: int  # padded sequences (decode: rows); a prefill graph has one
    width: int  # padded block-table width, in blocks
    is_decode: bool  # token generation (one query per row) rather than context encoding


@dataclass(frozen=True)
class XlaBuckets:
    decode_seqs: tuple[int, ...]  # rows of a decode step: requests, and the proposals they verify
    prefill_tokens: tuple[int, ...]  # positions of one prefill chunk; each a multiple of the devices
    widths: tuple[int, ...]  # block-table widths in blocks; the last holds max_model_len
    block_size: int

    @classmethod
    def from_config(
        cls, config: EngineConfig, max_model_len: int, num_devices: int, configured_len: int | None = None
    ) -> XlaBuckets:
        """From the engine's limits, or its explicit seq / token / block-table buckets, for a context of
        `max_model_len` positions served (`configured_len`: before the KV pool capped it; None: not).

        Raises ConfigError naming the flag whose buckets cannot hold what a step holds, or reach past
        it: a bucket larger than any step is padding alone, and its graph is compiled and its tensors
        allocated all the same (--seq-buckets 4,1000000 asked for 32.9 GB at warmup, naming nothing).
        The decoder checks them before it listens (api/start_checks.py's check_model)."""
        default_seqs = power_of_two_buckets(config.max_num_seqs)
        decode_seqs = config.seq_buckets or default_seqs
        check_reach("seq_buckets", decode_seqs, config.max_num_seqs, "--max-num-seqs")
        check_most(
            "seq_buckets", decode_seqs, max(config.max_rows_without_prompt, default_seqs[-1]), rows(config)
        )
        budget = config.max_num_batched_tokens
        prefill_tokens = config.token_buckets or fourfold(MIN_PREFILL_TOKENS, budget)
        if prefill_tokens[0] < 2:  # one position per sequence is a decode graph's shape
            if not config.token_buckets:  # the default buckets end at the budget: it is the flag
                raise ConfigError(
                    "max_num_batched_tokens",
                    f"must be at least 2 with --device neuron (a prefill chunk's graph holds 2 positions "
                    f"at least), got {budget}",
                )
            raise ConfigError(
                "token_buckets", f"must hold at least 2 positions each, got {prefill_tokens[0]}"
            )
        check_reach("token_buckets", prefill_tokens, budget, "--max-num-batched-tokens")
        # Sequence parallelism gives each device the same number of positions.
        most_tokens = -(-budget // num_devices) * num_devices
        check_most(
            "token_buckets",
            prefill_tokens,
            most_tokens,
            f"the positions of a prefill chunk: --max-num-batched-tokens {budget}"
            + ("" if num_devices == 1 else f", to a multiple of the {num_devices} devices"),
        )
        if any(n % num_devices for n in prefill_tokens):
            prefill_tokens = tuple(sorted({-(-n // num_devices) * num_devices for n in prefill_tokens}))
        max_width = -(-max_model_len // config.block_size)
        widths = config.block_table_buckets or fourfold(MIN_WIDTH, max_width)
        check_widths(config, widths, max_model_len, configured_len or max_model_len)
        return cls(tuple(decode_seqs), tuple(prefill_tokens), tuple(widths), config.block_size)

    def all(self) -> list[Bucket]:
        """Every graph a step can need, each once: decode rows x widths, then prefill chunks x widths."""
        buckets = [Bucket(n, n, w, True) for n in self.decode_seqs for w in self.widths]
        smaller = 0
        for n in self.prefill_tokens:
            buckets += [Bucket(n, 1, w, False) for w in self.widths if w * self.block_size > smaller]
            smaller = n
        return buckets

    def decode(self, num_rows: int, max_seq_len: int) -> Bucket:
        return Bucket(
            _fit(self.decode_seqs, num_rows), _fit(self.decode_seqs, num_rows), self.width(max_seq_len), True
        )

    def prefill(self, num_tokens: int, seq_len: int) -> Bucket:
        return Bucket(_fit(self.prefill_tokens, num_tokens), 1, self.width(seq_len), False)

    def width(self, seq_len: int) -> int:
        return _fit(self.widths, -(-seq_len // self.block_size))

    def describe(self) -> str:
        return (
            f"decode rows {list(self.decode_seqs)}, prefill positions {list(self.prefill_tokens)}, "
            f"block-table widths {list(self.widths)} x {self.block_size} positions: {len(self.all())} graphs"
        )


def fourfold(first: int, limit: int) -> tuple[int, ...]:
    """first, 4 * first, ... below limit, then limit."""
    sizes = [first]
    while sizes[-1] * 4 < limit:
        sizes.append(sizes[-1] * 4)
    return tuple(s for s in sizes if s < limit) + (limit,)


def _fit(buckets: tuple[int, ...], n: int) -> int:
    index = bisect_left(buckets, n)
    if index == len(buckets):
        raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
    return buckets[index]
