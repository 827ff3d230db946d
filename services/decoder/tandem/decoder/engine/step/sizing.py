"""How long a context, how many KV blocks and which buckets: derived from the config and the model.

Computed once when the engine is built, on every rank alike, and never written back into the config.
"""

from __future__ import annotations

from tandem.client.errors import ConfigError
from tandem.decoder.config import MAX_KV_SLOTS, EngineConfig
from tandem.decoder.engine.step.bucket_bounds import check_most, check_reach, check_widths, rows
from tandem.decoder.engine.step.kv_pool_agreement import KvPoolRefused
from tandem.decoder.engine.step.static_shapes import StaticShapes, power_of_two_buckets, width_buckets
from tandem.decoder.models.config import ModelConfig
from tandem.decoder.models.kv_pool import KvPoolUnallocated

DEFAULT_TOKEN_BUDGET: int = EngineConfig.max_num_batched_tokens  # the field's default (2,048)


def max_model_len(config: EngineConfig, model_config: ModelConfig, num_blocks: int | None = None) -> int:
    """The context cap: config.max_model_len, never past the checkpoint's max_position_embeddings, nor
    past what the KV pool of `num_blocks` (one of them the reserved null block) holds for one sequence.

    Without the pool's bound a default max_new_tokens was capped to a context the pool could never
    hold, and a request that set nothing was refused for a field it never sent (SmolLM2 at 40
    blocks: 8,192 advertised, 624 held). vLLM refuses to start instead; a pool sized on purpose
    (--num-kv-blocks, --kv-cache-bytes) is a choice, so here it shortens the context, and says so."""
    limit = model_config.max_position_embeddings
    cap = min(config.max_model_len or limit, limit)
    if num_blocks is not None:
        cap = min(cap, max(1, num_blocks - 1) * config.block_size)
    return cap


def check_sliding_window(config: EngineConfig, model_config: ModelConfig) -> None:
    """Refuses a checkpoint some layer of which attends to a window narrower than the context served.

    Sliding-window attention is not implemented: every layer here attends to the whole context, which
    is what the window gives only while no sequence outgrows it (a query at position p sees keys
    p - size + 1 .. p in transformers' mask). Mistral v0.1's window is 4,096 beside a 32,768-position
    context: served as is it would answer long prompts wrongly, and silently. The context served is
    --max-model-len, else max_position_embeddings, so the flag makes such a checkpoint fit. Raises
    ConfigError naming max_model_len."""
    window = model_config.sliding_window
    context = max_model_len(config, model_config)
    if window is None or context <= window.size:
        return
    is_flag = config.max_model_len is not None and config.max_model_len <= context
    got = f"{context}" if is_flag else f"{context} (config.json's max_position_embeddings)"
    raise ConfigError(
        "max_model_len",
        f"must be at most {window.size} to serve this checkpoint, got {got}: config.json's "
        f"{window.said} narrows what each query attends to, and this decoder attends to the whole "
        "context (sliding-window attention is not implemented)",
    )


def num_kv_blocks(config: EngineConfig, model_config: ModelConfig, world_size: int) -> int:
    """KV blocks in the pool: config.num_kv_blocks, or as many as fit in kv_cache_bytes on each rank.

    Every rank computes the same count (each holds num_kv_heads / world_size heads of every block).
    Raises ConfigError naming kv_cache_bytes when its blocks are more than a pool may hold
    (config.max_kv_blocks, which the config checks --num-kv-blocks against itself), or naming
    max_num_batched_tokens when a step's budget is past what the pool holds (check_token_budget).
    """
    if config.num_kv_blocks:
        check_token_budget(config, config.num_kv_blocks)
        return config.num_kv_blocks
    c = model_config
    num_kv_heads = c.num_kv_heads // world_size
    per_block = 2 * c.num_layers * config.block_size * num_kv_heads * c.head_dim * c.dtype.itemsize
    num_blocks = max(2, config.kv_cache_bytes // per_block + 1)  # + the reserved null block
    if num_blocks > config.max_kv_blocks:
        # The bytes buy floor(bytes / per_block) blocks beside the reserved one: at most max_kv_blocks - 1
        # of them while the bytes are less than max_kv_blocks whole blocks.
        max_bytes = config.max_kv_blocks * per_block - 1
        raise ConfigError(
            "kv_cache_bytes",
            f"must be at most {max_bytes:,} for this model (a byte less than {config.max_kv_blocks:,} "
            f"blocks of {per_block:,} bytes on each rank, which buys {config.max_kv_blocks - 1:,} blocks "
            f"and the reserved one: {MAX_KV_SLOTS:,} KV slots, int32's, of --block-size "
            f"{config.block_size}), got {config.kv_cache_bytes:,}",
        )
    check_token_budget(config, num_blocks)
    return num_blocks


def max_token_budget(block_size: int, num_blocks: int) -> int:
    """The most --max-num-batched-tokens beside a pool of `num_blocks` blocks of `block_size`: the
    positions they hold beside the reserved one, never under the default (`check_token_budget`)."""
    return max((num_blocks - 1) * block_size, DEFAULT_TOKEN_BUDGET)


def check_token_budget(config: EngineConfig, num_blocks: int) -> None:
    """Refuses a step's token budget (--max-num-batched-tokens) past the positions a pool of
    `num_blocks` blocks holds beside the reserved one, unless it is the default's or less.

    Every position a step computes takes a KV slot, so no step fills a budget past the pool (TGI
    refuses its max_batch_prefill_tokens past max_batch_total_tokens alike). Such a budget is not
    harmless: static shapes warm a power-of-two token bucket past it, and --max-num-batched-tokens 2**63
    walked buckets up to 2**64 and never finished starting. The default (2,048) stays valid beside
    any pool, however small, as it always was. Raises ConfigError."""
    most = max_token_budget(config.block_size, num_blocks)
    if config.max_num_batched_tokens > most:
        raise ConfigError(
            "max_num_batched_tokens",
            f"must be at most {most:,} (the positions the KV pool holds: {num_blocks - 1:,} blocks of "
            f"{config.block_size} beside the reserved one, each position a step computes taking one; "
            f"never under the default {DEFAULT_TOKEN_BUDGET:,}), got {config.max_num_batched_tokens:,}",
        )


def pool_refused(config: EngineConfig, error: KvPoolUnallocated) -> KvPoolRefused:
    """A KV pool the host could not allocate as the start-up error of the flag that sized it."""
    where = "this rank" if error.rank is None else f"rank {error.rank}"
    asked = f"{error.num_blocks:,} blocks, {error.num_bytes:,} bytes on {where}"
    if config.num_kv_blocks:
        return KvPoolRefused(
            "num_kv_blocks",
            f": the KV pool it asks for ({asked}) could not be allocated ({error.cause}): ask for fewer "
            "blocks, or leave it unset to size the pool by --kv-cache-bytes",
        )
    return KvPoolRefused(
        "kv_cache_bytes",
        f": the KV pool it asks for ({asked}) could not be allocated ({error.cause}): give it fewer bytes",
    )


def static_shapes(
    config: EngineConfig, max_model_len: int, configured_len: int | None = None
) -> StaticShapes | None:
    """Static-shape mode's buckets (None when it is off), for a context of `max_model_len` positions
    served; `configured_len` is the context before the KV pool capped it (None: not capped). Raises
    ConfigError naming the flag whose buckets cannot hold what a step holds, or reach past the default
    buckets' largest (a larger one is padding alone: its steps compute and its graph compiles all the
    same). The decoder checks them before it listens (api/start_checks.py's check_model)."""
    if not config.static_shapes:
        return None
    # One spare sequence bucket: padding tokens need a padding sequence to live in, and each
    # padding sequence holds at least one token on top of the real ones.
    default_seqs = power_of_two_buckets(config.max_rows_without_prompt + 1)
    seq_buckets = config.seq_buckets or power_of_two_buckets(config.max_num_seqs + 1)
    # A step of --max-num-seqs sequences whose positions fill no token bucket exactly pads them into
    # one more sequence (static_shapes.padded_sizes): with --max-num-seqs 4 and --seq-buckets 1,2,4
    # the engine failed every request, "5 exceeds the largest bucket 4".
    padded = f"--max-num-seqs {config.max_num_seqs} and a padding sequence"
    check_reach("seq_buckets", seq_buckets, config.max_num_seqs + 1, padded)
    check_most("seq_buckets", seq_buckets, default_seqs[-1], f"{rows(config)}, and a padding one")
    tokens = config.max_num_batched_tokens + seq_buckets[-1]
    token_buckets = config.token_buckets or power_of_two_buckets(tokens)
    what = f"--max-num-batched-tokens {config.max_num_batched_tokens} plus the largest seq bucket"
    check_reach("token_buckets", token_buckets, tokens, what)
    check_most("token_buckets", token_buckets, power_of_two_buckets(tokens)[-1], f"{what}, to a power of two")
    max_width = -(-max_model_len // config.block_size)  # blocks of the longest allowed sequence
    block_table_widths = config.block_table_buckets or width_buckets(max_width)
    check_widths(config, block_table_widths, max_model_len, configured_len or max_model_len)
    return StaticShapes(
        token_buckets=token_buckets,
        seq_buckets=seq_buckets,
        block_table_widths=block_table_widths,
    )
