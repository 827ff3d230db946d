"""The engine's core assembled from its config: the runner and its KV pool, the block manager, the
scheduler's limits, and the core over them; and the XLA pool's refusal before the model is loaded.

Sizes (context, KV blocks, buckets) come from step/sizing.py; which buckets and which runner from the
backend (static shapes on CPU and CUDA when configured, XLA's own buckets on Neuron).
"""

from __future__ import annotations

import logging
import os

from tandem.decoder.backends import backend as backends
from tandem.decoder.backends.xla.host_pool import check_host_pool
from tandem.decoder.config import EngineConfig
from tandem.decoder.engine.front.loop import EngineThread
from tandem.decoder.engine.front.peers import RankGroup, RankZeroPeers
from tandem.decoder.engine.scheduling.adapters import AdapterSlots
from tandem.decoder.engine.scheduling.kv_cache import BlockManager
from tandem.decoder.engine.scheduling.scheduler import Scheduler
from tandem.decoder.engine.scheduling.scheduler_config import SchedulerConfig
from tandem.decoder.engine.step import grammar_budget, sizing
from tandem.decoder.engine.step.core import EngineCore
from tandem.decoder.engine.step.runner import ModelRunner
from tandem.decoder.engine.step.xla_buckets import XlaBuckets
from tandem.decoder.models.config import ModelConfig
from tandem.decoder.models.kv_pool import KvPoolUnallocated
from tandem.decoder.models.loader import LoadedModel
from tandem.decoder.models.lora import LoraTable
from tandem.decoder.models.tensor_parallel import world_size_of

log = logging.getLogger(__name__)


def build_core(
    config: EngineConfig,
    loaded: LoadedModel,
    *,
    executor: backends.ModelStep,  # the model as the backend runs it (Engine._set_up)
    lora: LoraTable | None,  # the LoRA slots, on the host; None: LoRA is off
    num_blocks: int,  # the KV pool's blocks on this rank (step/sizing.py)
    max_model_len: int,  # the context, capped by the pool
    backend: backends.Backend,
    thread: EngineThread,  # the engine thread, where every torch op of set-up runs (loop.py)
    peers: RankZeroPeers,  # the other ranks, which agree on the KV pool (peers.py)
) -> EngineCore:
    """The runner (its KV pool allocated, and agreed by every rank), the block manager, the scheduler
    and the core over them, as the config and the backend ask. Raises KvPoolRefused naming
    --kv-cache-bytes or --num-kv-blocks where a rank's pool cannot be allocated."""
    # Batch-invariant: a cached prefix was computed in another request's chunks, and a request's
    # chunks are its own (max_num_batched_tokens each, the step's budget never cutting them).
    invariant = config.batch_invariant
    is_xla = backend.placement == "xla"  # its own buckets (engine/step/xla_buckets.py)
    configured = sizing.max_model_len(config, loaded.config)  # before the KV pool's cap
    static = None if is_xla else sizing.static_shapes(config, max_model_len, configured)
    xla_buckets = (
        XlaBuckets.from_config(config, max_model_len, config.num_devices, configured) if is_xla else None
    )
    max_num_rows = None if static is None else max(config.max_num_seqs, static.seq_buckets[-1] - 1)
    if xla_buckets is not None:  # a decode graph holds every row: decodes and verified proposals
        max_num_rows = xla_buckets.decode_seqs[-1]
    # The pool before the block table: the table costs a Python object per block (~170 bytes), so
    # a pool the device cannot hold is refused before the table of it is built.
    try:
        if xla_buckets is not None:
            from tandem.decoder.backends.xla.sharding import ShardingPlan
            from tandem.decoder.engine.step.xla_runner import XlaRunner  # imports torch_xla's SPMD API

            log.info("XLA buckets: %s", xla_buckets.describe())
            runner: ModelRunner = thread.run(
                XlaRunner,
                loaded.model,
                num_blocks,
                config.block_size,
                xla_buckets,
                ShardingPlan(config.num_devices),
                invariant,
                lora,
            )
        else:
            runner = thread.run(
                ModelRunner,
                loaded.model,
                num_blocks,
                config.block_size,
                static,
                peers.feed,
                backend if config.compile else None,
                invariant,
                executor,
                lora,
            )
        refused = None
    except KvPoolUnallocated as error:  # a bare OSError [Errno 12] before, naming no flag
        refused = error
    refused = peers.agree_on_pool(thread, refused)  # a refusal on any rank is the group's
    if refused is not None:
        raise sizing.pool_refused(config, refused) from None
    block_manager = BlockManager(
        num_blocks, config.block_size, config.enable_prefix_caching and not invariant
    )
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens * (config.max_num_seqs if invariant else 1),
            max_waiting=config.max_queue,
            max_tokens_per_request=config.max_num_batched_tokens if invariant else None,
            # A verified proposed token is a sequence of its own, and padding needs a spare one.
            max_num_rows=max_num_rows,
            shared_step_seqs=(
                backend.shared_step_seqs if config.shared_step_seqs is None else config.shared_step_seqs
            )
            or None,
            # Batch-invariant chunks are the request's own, whatever decodes beside them.
            long_prefill_token_threshold=None if invariant else config.long_prefill_token_threshold or None,
            # Each XLA chunk runs as a graph padded up to a prefill bucket: a capped one fills one.
            prefill_buckets=None if xla_buckets is None else xla_buckets.prefill_tokens,
        ),
        block_manager,
    )
    adapters = None if lora is None else AdapterSlots(config.max_loras)
    return EngineCore(
        scheduler,
        runner,
        loaded.config.vocab_size,
        config.speculative_max_batch,
        adapters,
        max_grammar_seconds_per_step=config.max_grammar_cpu_ms_per_step / 1000,
        heavy_mask_seconds=grammar_budget.heavy_mask_seconds(config.max_grammar_cpu_ms_per_token / 1000),
    )


def check_xla_host_pool(config: EngineConfig, model_config: ModelConfig, tp: RankGroup | None) -> None:
    """The KV pool's copies on XLA's CPU device against the host's memory, as `tandem serve decoder`
    checks before it listens (api/start_checks.py's check_model): an engine built in process (the offline
    API, tests) mapped a pool past it and met the OOM killer. Run before the load, whose runtime
    start and weights took 5-8 s of a tiny model before the refusal (minutes of a large one).
    Raises KvPoolRefused naming --kv-cache-bytes or --num-kv-blocks."""
    num_blocks = sizing.num_kv_blocks(config, model_config, world_size_of(tp))
    try:
        check_host_pool(model_config, num_blocks, config.block_size, config.num_devices, os.environ)
    except KvPoolUnallocated as error:
        raise sizing.pool_refused(config, error) from None
