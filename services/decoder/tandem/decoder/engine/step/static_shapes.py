"""Static-shape preparation: a packed step padded to one of a known set of bucket sizes.

Static-shape mode pads the token count and the sequence count to buckets and always passes both
`inputs_embeds` (zeros) and `is_token_ids` (all True where not an embedding), so every step has
one of a known set of input signatures; warmup runs each once and the runner records them.
Padding tokens write their KV into the reserved null block 0 and attend to it alone.

The block-table width is a bucket too, for decode steps: a decode step that gathers its context
(the torch path a compiled or traced bucket runs) costs what the width holds, so a batch of short
sequences pads its tables to a short width, not to the longest allowed context. Steps with any
prefill run eagerly and keep the widest table, so they add no signatures.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

from tandem.decoder.engine.scheduling.kv_cache import NULL_BLOCK_ID
from tandem.decoder.engine.step.batch import HostBatch


@dataclass(frozen=True)
class StaticShapes:
    """Buckets for static-shape mode; every padded size is one of these."""

    token_buckets: tuple[int, ...]  # padded num_tokens
    seq_buckets: tuple[int, ...]  # padded num_seqs
    block_table_widths: tuple[int, ...]  # padded block-table widths (blocks); the last holds max_model_len


def power_of_two_buckets(limit: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to the first power of two >= limit (so sequence buckets are token buckets)."""
    buckets = [1]
    while buckets[-1] < limit:
        buckets.append(buckets[-1] * 2)
    return tuple(buckets)


def width_buckets(max_width: int) -> tuple[int, ...]:
    """1, 4, 16, ... below max_width, then max_width: fourfold, so a decode bucket compiles few graphs."""
    widths = [1]
    while widths[-1] * 4 < max_width:
        widths.append(widths[-1] * 4)
    return tuple(widths) if widths[-1] == max_width else (*widths, max_width)


def warmup_shapes(static: StaticShapes) -> list[tuple[int, int, int]]:
    """Every (num_tokens, num_seqs, block_table_width) a padded step can have, each once."""
    shapes = []
    for num_seqs in static.seq_buckets:
        for num_tokens in static.token_buckets:
            if num_tokens < num_seqs:
                continue
            is_decode = num_tokens == num_seqs
            for width in static.block_table_widths if is_decode else static.block_table_widths[-1:]:
                shapes.append((num_tokens, num_seqs, width))
    return shapes


def padded_width(static: StaticShapes, host: HostBatch, block_size: int) -> int:
    """The block-table width of a padded step: the narrowest bucket for decodes, the widest otherwise."""
    if any(n != 1 for n in host.query_lens):
        return static.block_table_widths[-1]
    return _bucket(static.block_table_widths, -(-max(host.seq_lens) // block_size))


def pad_to_buckets(host: HostBatch, static: StaticShapes, block_size: int) -> None:
    """Pads `host` in place to bucketed (num_seqs, num_tokens) with padding sequences."""
    num_real_seqs, num_real_tokens = len(host.query_lens), len(host.input_ids)
    num_seqs, num_tokens = padded_sizes(static, num_real_seqs, num_real_tokens)
    pad_seqs = num_seqs - num_real_seqs
    # Each padding sequence holds one query; the last one also absorbs the remaining padding
    # tokens, so a batch is decode-only exactly when num_tokens == num_seqs.
    pad_query_lens = [1] * pad_seqs
    if pad_seqs:
        pad_query_lens[-1] += num_tokens - num_real_tokens - pad_seqs
    append_padding(host, pad_query_lens, block_size)
    # The logits count is part of the signature: always num_seqs rows, sampling rows first. A step
    # whose every sequence is mid-prefill, filling its buckets exactly, has no row to repeat: row 0.
    filler = host.logits_rows[-1] if host.logits_rows else 0
    host.logits_rows += [filler] * (num_seqs - len(host.logits_rows))
    host.logits_rows = host.logits_rows[:num_seqs]


def padding_batch(num_tokens: int, num_seqs: int, block_size: int) -> HostBatch:
    """An all-padding step of exactly these bucket sizes (warmup; writes only the null block)."""
    pad_query_lens = [1] * num_seqs
    pad_query_lens[-1] += num_tokens - num_seqs
    host = HostBatch()
    append_padding(host, pad_query_lens, block_size)
    return host


def append_padding(host: HostBatch, pad_query_lens: list[int], block_size: int) -> None:
    """One padding sequence per entry, each sampling its last position; token 0 everywhere."""
    for n in pad_query_lens:
        host.logits_rows.append(len(host.input_ids) + n - 1)
        host.input_ids.extend([0] * n)
        host.positions.extend(range(n))
        # A padding sequence writes and reads only the null block, however long it is.
        host.slots.extend(p % block_size for p in range(n))
        host.is_token_ids.extend([True] * n)
        host.lora_slots.extend([-1] * n)
        host.query_lens.append(n)
        host.seq_lens.append(n)
        host.block_tables.append((NULL_BLOCK_ID,))


def padded_sizes(static: StaticShapes, num_real_seqs: int, num_real_tokens: int) -> tuple[int, int]:
    """Bucketed (num_seqs, num_tokens); tokens padded only where a padding sequence can hold them."""
    num_seqs = _bucket(static.seq_buckets, num_real_seqs)
    num_tokens = _bucket(static.token_buckets, num_real_tokens + num_seqs - num_real_seqs)
    if num_tokens > num_real_tokens and num_seqs == num_real_seqs:
        num_seqs = _bucket(static.seq_buckets, num_real_seqs + 1)
        num_tokens = _bucket(static.token_buckets, num_real_tokens + num_seqs - num_real_seqs)
    return num_seqs, num_tokens


def _bucket(buckets: tuple[int, ...], n: int) -> int:
    index = bisect_left(buckets, n)
    if index == len(buckets):
        raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
    return buckets[index]
