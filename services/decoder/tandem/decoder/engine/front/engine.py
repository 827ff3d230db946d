"""The engine: a model, its KV pool and scheduler, stepped on a thread of its own (`loop.py`).

Fronts: `generate()` for in-process use (a blocking iterator of events) and `stream()` for the
asyncio servicer (an async iterator, `streaming.py`; cancelling it aborts the request). Sizes derived
from the config and the model (context, KV blocks, buckets) are computed in `step/sizing.py`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from functools import partial
from pathlib import Path
from typing import Protocol

import torch

from tandem.client.errors import Unavailable
from tandem.common import text_bounds
from tandem.common.model_name import echo
from tandem.decoder.backends import backend as backends
from tandem.decoder.backends.xla.host_pool import check_host_pool
from tandem.decoder.config import EngineConfig
from tandem.decoder.engine.admission import template_worker
from tandem.decoder.engine.admission.chat import ChatTemplate
from tandem.decoder.engine.admission.prompt import GenerateSpec, build_request, check_spec, has_encoder_parts
from tandem.decoder.engine.admission.prompt_logprob_budget import PromptLogprobBudget, num_entries
from tandem.decoder.engine.admission.prompt_logprob_size import PromptLogprobSize
from tandem.decoder.engine.front.fair_builder import FairBuilder
from tandem.decoder.engine.front.loop import EngineThread
from tandem.decoder.engine.front.streaming import Mailboxes, stream_events
from tandem.decoder.engine.outputs.backpressure import ReaderProgress, unread_weight
from tandem.decoder.engine.outputs.outputs import Delta, Event, Failed, Finished, FinishReason, OutputState
from tandem.decoder.engine.outputs.prompt_logprobs import PromptLogprobsBuffer
from tandem.decoder.engine.outputs.token_bytes import token_bytes_table
from tandem.decoder.engine.request import Request
from tandem.decoder.engine.sampling.structured import GrammarCompiler
from tandem.decoder.engine.scheduling.adapters import Adapter, AdapterSlots
from tandem.decoder.engine.scheduling.kv_cache import BlockManager
from tandem.decoder.engine.scheduling.scheduler import Scheduler, SchedulerConfig
from tandem.decoder.engine.step import grammar_budget, sizing
from tandem.decoder.engine.step.core import EngineCore, EngineFault, EventCallback
from tandem.decoder.engine.step.kv_pool_agreement import first_refusal, say_failed
from tandem.decoder.engine.step.runner import ModelRunner, StepFeed
from tandem.decoder.engine.step.xla_buckets import XlaBuckets
from tandem.decoder.models.adapter_root import AdapterRoot, start_up_shown
from tandem.decoder.models.config import ModelConfig
from tandem.decoder.models.kv_pool import KvPoolUnallocated
from tandem.decoder.models.loader import LoadedModel, load_model, read_model_config
from tandem.decoder.models.lora import LoraTable
from tandem.decoder.models.peft_adapter import FoundAdapter, LoraAdapter, read_adapter
from tandem.decoder.models.tensor_parallel import ParallelGroup, world_size_of

log = logging.getLogger(__name__)

FETCHING_BUILDERS = 8  # requests built at once while they wait for their encoder parts' rows


class RankGroup(ParallelGroup, Protocol):
    """Rank 0's view of its group of ranks; the decoder passes `distributed.parallel.ParallelContext`."""

    timeout_s: float  # a collective waiting longer fails, so idle rank 0 sends keepalives well within it

    def step_sender(self) -> StepFeed: ...  # feeds every step to the other ranks' worker loops

    # Every rank's host tensor, stacked in rank order (start-up's agreements: kv_pool_agreement.py).
    # `within_s`: this rank waits that long at most, raising TimeoutError (kv_pool_agreement.say_failed).
    def all_gather_control(self, x: torch.Tensor, within_s: float | None = None) -> torch.Tensor: ...


class Engine:
    """With `tp` (several ranks) this is rank 0: it feeds every step to the others' worker loops."""

    def __init__(
        self,
        config: EngineConfig,
        loaded: LoadedModel | None = None,
        tp: RankGroup | None = None,
        backend: backends.Backend | None = None,  # None: config.device's; tests may swap the compiler
    ) -> None:
        self.config = config
        backend = backend or backends.check_available(config.device)
        self._thread = EngineThread(config.num_threads or torch.get_num_threads())
        # Adapters are read (files, checks) here, off the engine thread; their slots are written on it.
        self._adapter_reader = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="tandem-adapters", initializer=_init_builder_thread
        )
        # Request building and tokenizing for the asyncio front run here, never on the event loop:
        # a long text or a large embedding tensor would stall every stream and health probe for its
        # duration. One thread, so that heavy requests queue behind each other, not beside the model.
        # These builders take the callers in turn (fair_builder.py): one caller's burst of dear
        # builds holds another's request back by at most one build per caller.
        self._builder = FairBuilder(1, "tandem-requests", _init_builder_thread)
        # Chat requests build beside it, as many at once as there are template workers: a render
        # waits on its worker process (admission/template_worker.py, up to its time bound), and a
        # slow template must hold up neither other callers' plain prompts nor, up to that many,
        # their chats.
        self._chat_builder = FairBuilder(template_worker.WORKERS, "tandem-chats", _init_builder_thread)
        # Prompts and chats with a grammar build here: compiling one costs up to a few hundred
        # milliseconds (llguidance's bounds, sampling/structured.py), and 6 hostile ones queued on
        # the plain builder held a neighbour's first token back 16-20 s. One thread: grammars queue
        # behind each other, never in front of prompts or chats without one.
        self._structured_builder = FairBuilder(1, "tandem-grammars", _init_builder_thread)
        # Requests with encoder parts build here: each waits for its encoder's rows (a vision tower's
        # tens of milliseconds), which must hold up neither plain prompts nor chats; the threads only
        # wait, so there can be several.
        self._fetching_builder = concurrent.futures.ThreadPoolExecutor(
            max_workers=FETCHING_BUILDERS,
            thread_name_prefix="tandem-fetching",
            initializer=_init_builder_thread,
        )
        # Idle rank 0 sends keepalives well within the group timeout; one rank just sleeps.
        self._keepalive_s = None if tp is None else tp.timeout_s / 4
        self._keys = itertools.count()  # the engine's own request keys (see submit)
        self._mailboxes = Mailboxes()
        # Rank 0 of several: the other ranks' feed, which runs every step and adapter install there too.
        # Where they wait on this rank (rank_zero_failed.py): loading, then in the KV pool's agreement,
        # then in their step loops, where the feed reaches them.
        self._peers: StepFeed | None = None if tp is None else tp.step_sender()
        self._peers_at_agreement = tp is not None
        self._peers_listening = False
        # The rest holds memory, the threads above and the chat template's worker processes: a set-up
        # that fails part way releases what it made (a refused KV pool left the engine thread waiting
        # and the template's workers running in the caller's process; a --lora that could not be read
        # called shutdown() on builder threads not made yet, an AttributeError in its error's place).
        try:
            self._set_up(loaded, tp, backend)
        except BaseException:
            if self._peers_at_agreement:
                assert tp is not None
                self._say_failed(tp)
            self._close(failed=True)
            raise

    def _set_up(self, loaded: LoadedModel | None, tp: RankGroup | None, backend: backends.Backend) -> None:
        """The model, its executor, the chat template, the KV pool and the core; then --lora's adapters."""
        config = self.config
        if backend.placement == "xla":  # from config.json's numbers: a refusal at once, before the load
            self._check_host_pool(
                loaded.config if loaded is not None else read_model_config(config.model_dir, config.dtype), tp
            )
        self.loaded = loaded or self._thread.run(
            load_model,
            config.model_dir,
            config.dtype,
            backends.start_device(config.device, config.num_devices),
            tp,
            config.quantization,
            config.quantized_from,
            config.quantization_group_size,
        )
        # LoRA slots, every one empty until an adapter is loaded into it (models/lora.py).
        self.lora: LoraTable | None = None
        if config.enable_lora:
            model = self.loaded.model
            # On the host, where adapters are written; an XLA step keeps a device copy (backends/xla/lora.py).
            self.lora = self._thread.run(
                LoraTable, model.config, config.max_loras, config.max_lora_rank, torch.device("cpu"), tp
            )
        # Where LoadAdapter's callers may read adapters from (--lora-root); None: nowhere.
        self.adapter_root = None if config.lora_root is None else AdapterRoot(config.lora_root)
        if self.adapter_root is not None:
            log.info("LoadAdapter reads adapters inside %s only", self.adapter_root.root)
        # A caller's model runs as given (tests compare against it); one this engine loaded runs on the
        # backend's executor, its kernels chosen for this machine.
        self.executor: backends.ModelStep = (
            self.loaded.model
            if loaded is not None
            else self._thread.run(
                backends.prepare_model,
                self.loaded.model,
                backend,
                config.compile,
                config.native_kernels,
                config.kernel_options,
                self.lora,
            )
        )
        self.model_config = self.loaded.config
        self.tokenizer = self.loaded.tokenizer
        # The chat template (if any) and the tokenizer's plain-text twin, built once.
        self.chat_template = ChatTemplate.load(Path(config.model_dir), self.tokenizer)
        self._grammars: GrammarCompiler | None = None  # structured output, made on first use
        self._grammars_lock = threading.Lock()
        sizing.check_sliding_window(config, self.model_config)  # main refused it before listening too
        self.num_blocks = sizing.num_kv_blocks(config, self.model_config, world_size_of(tp))
        self.max_model_len = sizing.max_model_len(config, self.model_config, self.num_blocks)
        if self.max_model_len < sizing.max_model_len(config, self.model_config):
            log.warning(
                "the KV pool (%d blocks of %d positions, one reserved) holds %d positions: the context "
                "is capped there, not at %d (raise --kv-cache-bytes or --num-kv-blocks for more)",
                self.num_blocks, config.block_size, self.max_model_len,
                sizing.max_model_len(config, self.model_config),
            )  # fmt: skip
        self.prompt_logprob_budget = PromptLogprobBudget(self.max_model_len)
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids)
        self.max_token_chars = text_bounds.max_token_chars(self.tokenizer)
        # Each token's own bytes for logprobs (`Delta`s carry IDs; the servicer spells them): once, here.
        self.token_bytes = token_bytes_table(self.tokenizer)
        self.prompt_logprob_size = PromptLogprobSize.of(self.token_bytes, self.model_config.vocab_size)
        self.core = self._build_core(tp, backend)
        for name, path in config.loras:  # --lora NAME=PATH, each into its slot before serving
            adapter = self._adapter_reader.submit(self._read_adapter, name, path).result()
            shown = start_up_shown(path) if self.adapter_root is None else self.adapter_root.shown(path)
            installing = self.core.between_steps(partial(self._install, name, shown, adapter))
            self._thread.run(self.core.run_between_steps)
            installing.result()

    def _check_host_pool(self, model_config: ModelConfig, tp: RankGroup | None) -> None:
        """The KV pool's copies on XLA's CPU device against the host's memory, as `tandem serve decoder`
        checks before it listens (api/main.py's check_model): an engine built in process (the offline
        API, tests) mapped a pool past it and met the OOM killer. Run before the load, whose runtime
        start and weights took 5-8 s of a tiny model before the refusal (minutes of a large one).
        Raises KvPoolRefused naming --kv-cache-bytes or --num-kv-blocks."""
        config = self.config
        num_blocks = sizing.num_kv_blocks(config, model_config, world_size_of(tp))
        try:
            check_host_pool(model_config, num_blocks, config.block_size, config.num_devices, os.environ)
        except KvPoolUnallocated as error:
            raise sizing.pool_refused(config, error) from None

    def _build_core(self, tp: RankGroup | None, backend: backends.Backend) -> EngineCore:
        config = self.config
        # Batch-invariant: a cached prefix was computed in another request's chunks, and a request's
        # chunks are its own (max_num_batched_tokens each, the step's budget never cutting them).
        invariant = config.batch_invariant
        is_xla = backend.placement == "xla"  # its own buckets (engine/step/xla_buckets.py)
        configured = sizing.max_model_len(config, self.model_config)  # before the KV pool's cap
        static = None if is_xla else sizing.static_shapes(config, self.max_model_len, configured)
        xla_buckets = (
            XlaBuckets.from_config(config, self.max_model_len, config.num_devices, configured)
            if is_xla
            else None
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
                runner: ModelRunner = self._thread.run(
                    XlaRunner,
                    self.loaded.model,
                    self.num_blocks,
                    config.block_size,
                    xla_buckets,
                    ShardingPlan(config.num_devices),
                    invariant,
                    self.lora,
                )
            else:
                runner = self._thread.run(
                    ModelRunner,
                    self.loaded.model,
                    self.num_blocks,
                    config.block_size,
                    static,
                    self._peers,
                    backend if config.compile else None,
                    invariant,
                    self.executor,
                    self.lora,
                )
            refused = None
        except KvPoolUnallocated as error:  # a bare OSError [Errno 12] before, naming no flag
            refused = error
        if tp is not None:  # a refusal on any rank is the group's (kv_pool_agreement.py)
            self._peers_at_agreement = False  # met there now, failing or not: never a second gather
            refused = self._thread.run(first_refusal, tp, refused)
        if refused is not None:
            raise sizing.pool_refused(config, refused) from None
        self._peers_listening = tp is not None
        block_manager = BlockManager(
            self.num_blocks, config.block_size, config.enable_prefix_caching and not invariant
        )
        scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens
                * (config.max_num_seqs if invariant else 1),
                max_waiting=config.max_queue,
                max_tokens_per_request=config.max_num_batched_tokens if invariant else None,
                # A verified proposed token is a sequence of its own, and padding needs a spare one.
                max_num_rows=max_num_rows,
                shared_step_seqs=(
                    backend.shared_step_seqs if config.shared_step_seqs is None else config.shared_step_seqs
                )
                or None,
                # Batch-invariant chunks are the request's own, whatever decodes beside them.
                long_prefill_token_threshold=None
                if invariant
                else config.long_prefill_token_threshold or None,
                # Each XLA chunk runs as a graph padded up to a prefill bucket: a capped one fills one.
                prefill_buckets=None if xla_buckets is None else xla_buckets.prefill_tokens,
            ),
            block_manager,
        )
        adapters = None if self.lora is None else AdapterSlots(config.max_loras)
        return EngineCore(
            scheduler,
            runner,
            self.model_config.vocab_size,
            config.speculative_max_batch,
            adapters,
            max_grammar_seconds_per_step=config.max_grammar_cpu_ms_per_step / 1000,
            heavy_mask_seconds=grammar_budget.heavy_mask_seconds(config.max_grammar_cpu_ms_per_token / 1000),
        )

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> Engine:
        try:
            if self.config.static_shapes:
                self._thread.run(self.warmup)
        except BaseException:
            self._close(failed=True)
            raise
        self._thread.start(self.core, self._keepalive_s)
        return self

    def shutdown(self) -> None:
        """Stop the loop; requests still open end with UNAVAILABLE."""
        self._close(failed=self._thread.error is not None)

    def _close(self, failed: bool) -> None:
        """Release everything; `failed`: set-up, warmup or a step failed, which the other ranks are told."""
        self._builder.shutdown(wait=False, cancel_futures=True)
        self._chat_builder.shutdown(wait=False, cancel_futures=True)
        self._fetching_builder.shutdown(wait=False, cancel_futures=True)
        self._structured_builder.shutdown(wait=False, cancel_futures=True)
        self._adapter_reader.shutdown(wait=False, cancel_futures=True)
        chat_template = getattr(self, "chat_template", None)  # None: a set-up that failed before it
        if chat_template is not None:
            chat_template.close()
        self._thread.stop()
        # A step running when asked to stop (a drain) may fail only now, at the group timeout of a hung peer.
        failed = failed or self._thread.error is not None
        core = getattr(self, "core", None)  # None: a set-up that failed before the core was built
        if core is not None:
            core.fail_all(Unavailable("the decoder is shutting down"))
            core.close()
            summary = core.runner.summary()
            if summary is not None:
                log.info("%s", summary)
        if self._peers_listening:
            self._stop_peers(failed)

    def _say_failed(self, tp: RankGroup) -> None:
        """The other ranks, loading or waiting in the KV pool's agreement, stop there."""
        try:
            self._thread.run(say_failed, tp)
        except TimeoutError:  # still loading: they stop there if they reach it while this process lives
            log.info("the other ranks have not reached the KV pool's agreement yet; not waiting for them")
        except Exception as error:  # a rank already gone: nothing to tell
            log.warning("could not tell the other ranks to stop at the KV pool's agreement: %s", error)

    def _stop_peers(self, failed: bool) -> None:
        """The other ranks' worker loops end: STOP, or ABORT when this rank failed (they exit non-zero at
        once; without it they waited out the group timeout). Sent once: a second shutdown sends nothing.
        Either waits 1 s at most (step_broadcast.END_WAIT_S): a rank still inside a step's collectives
        takes it once they end, or fails at the group timeout; a hung one no longer holds this shutdown."""
        assert self._peers is not None
        self._peers_listening = False
        word = "ABORT" if failed else "STOP"
        try:
            if failed:
                self._peers.abort()
            else:
                self._peers.stop()
        except TimeoutError as error:  # left queued: taken later (inside a step), or the rank times out
            log.warning("the other ranks did not take %s at once (inside a step, or hung): %s", word, error)
        except Exception as error:  # a rank gone (or the fault was the group's): nothing to tell
            log.warning("could not send the other ranks %s (one gone?): %s", word, error)

    @property
    def is_healthy(self) -> bool:
        return self._thread.is_healthy

    def __enter__(self) -> Engine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def warmup(self) -> None:
        """Static mode: every bucket (tokens, seqs, table width) runs once on dummy inputs, none later."""
        runner = self.core.runner
        runner.warm_up()
        if runner.compiler is not None:
            log.info(
                "compiled %d decode buckets (%d graphs) in %.1f s",
                len(runner.compiled_steps),
                runner.compiler.num_graphs,
                runner.compiler.compile_s,
            )

    # -- requests --------------------------------------------------------------------------------

    def submit(
        self, spec: GenerateSpec, on_event: EventCallback, progress: ReaderProgress | None = None
    ) -> str:
        """Validate and admit; events go to `on_event` on the engine thread. Returns the engine's key
        for the request, which `abort` takes.

        NOTE: two names. The caller's `request_id` is a label, echoed in every event and never looked
        up, so callers need not coordinate their IDs and one caller's ID never reaches another's
        request. The engine keys a request by a name of its own, unique for the engine's life; an
        empty caller ID gets a random one (a UUID), which says nothing about other requests.

        With `progress`, the request pauses while the reader of `on_event`'s events is far behind,
        and its prompt logprobs are held against its caller's budget
        (admission/prompt_logprob_budget.py) until the stream closes `progress`.
        """
        if not self._thread.is_healthy:
            raise Unavailable("the decoder engine is not running")
        request = self.make_request(spec)
        if spec.max_reply_bytes is not None and request.sampling.prompt_logprobs is not None:
            self.prompt_logprob_size.check(
                request.prompt_token_ids,
                request.is_token_ids,
                request.sampling.prompt_logprobs,
                request.stopping.max_new_tokens,
                request.sampling.top_logprobs,
                spec.max_reply_bytes,
            )
        if progress is not None and request.sampling.prompt_logprobs is not None:
            entries = num_entries(request.num_prompt_tokens, request.sampling.prompt_logprobs)
            progress.hold(self.prompt_logprob_budget.reserve(request.caller, entries))
        output = OutputState(
            spec.request_id or uuid.uuid4().hex,
            request.prompt_token_ids,
            request.is_token_ids,
            request.stopping,
            spec.output,
            self.tokenizer,
            self._eos_token_ids(spec),
            self.max_model_len,
            request.arrival_time,
            _prompt_logprobs_buffer(request),
        )
        self.core.add(request, output, on_event, spec.deadline, progress)
        self._thread.wake()
        return request.request_id

    def abort(self, key: str) -> None:
        """Abort the request `submit` returned `key` for (a no-op once it has ended)."""
        self.core.abort(key)
        self._thread.wake()

    def _eos_token_ids(self, spec: GenerateSpec) -> frozenset[int]:
        """A chat reply also ends at the template's end-of-turn token (left out of the text like EOS)."""
        if spec.chat is None:
            return self.eos_token_ids
        return self.eos_token_ids | frozenset(self.chat_template.end_of_turn_ids)

    def finish_all(self, reason: FinishReason) -> int:
        """End every open request at the next step with `reason` (a drain out of time); how many."""
        num_live = self.core.finish_all(reason)
        self._thread.wake()
        return num_live

    def check_spec(self, spec: GenerateSpec) -> None:
        """The rules `make_request` checks before it reads any position (prompt.check_spec): for a caller
        that must refuse before it spends on the prompt, as the servicer before an encoder fetch."""
        check_spec(
            spec,
            vocab_size=self.model_config.vocab_size,
            hidden_size=self.model_config.hidden_size,
            max_model_len=self.max_model_len,
            enable_prompt_embeds=self.config.enable_prompt_embeds,
            has_chat_template=self.chat_template.source is not None,
            has_structured=True,  # `_grammar_compiler`, made on first use
            max_token_chars=self.max_token_chars,
            template_variables=self.chat_template.special,
        )

    def make_request(self, spec: GenerateSpec) -> Request:
        """Flatten and validate a spec against this engine's model; raises InvalidArgument."""
        return build_request(
            spec,
            f"#{next(self._keys)}",
            self.tokenizer,
            self.model_config,
            self.max_model_len,
            self.config.enable_prompt_embeds,
            self.chat_template,
            max_token_chars=self.max_token_chars,
            default_speculative_tokens=self.config.speculative_tokens,
            grammars=self._grammar_compiler,
        )

    def _grammar_compiler(self) -> GrammarCompiler:
        """The engine's grammar compiler, made by the first structured request (llguidance loads then)."""
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler(
                    self.tokenizer,
                    self.model_config.vocab_size,
                    self.model_config.eos_token_ids,
                    max_token_cpu_seconds=self.config.max_grammar_cpu_ms_per_token / 1000,
                )
            return self._grammars

    def generate(self, spec: GenerateSpec) -> Iterator[Event]:
        """In-process API: yields Accepted, Delta*, then Finished or Failed. The request pauses while
        the caller leaves Deltas untaken (outputs/backpressure.py) and resumes as it iterates on."""
        events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        progress = ReaderProgress(self._thread.wake)

        def on_event(event: Event) -> None:
            if isinstance(event, Delta):
                progress.handed(unread_weight(event.token_ids, event.prompt_logprobs))
            events.put(event)

        try:
            key = self.submit(spec, on_event, progress)
        except BaseException:
            progress.close()
            raise
        finished = False
        try:
            while True:
                event = events.get()
                if isinstance(event, Delta):
                    progress.taken(unread_weight(event.token_ids, event.prompt_logprobs))
                yield event
                if isinstance(event, Finished | Failed):
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(key)
            progress.close()

    def stream(self, spec: GenerateSpec) -> AsyncIterator[Event]:
        """asyncio front: the same events; leaving early (cancel, error) aborts the request. The
        request is built (validated, tokenized, cast) on the request-building thread; it arrived now,
        where its caller did not say, so its metrics count its wait for that thread."""
        if spec.arrival_time is None:
            spec = dataclasses.replace(spec, arrival_time=time.monotonic())
        progress = ReaderProgress(self._thread.wake)
        return stream_events(
            self._mailboxes,
            lambda on_event: self.submit(spec, on_event, progress),
            self.abort,
            self._builder_for(spec),
            progress,
        )

    def _builder_for(self, spec: GenerateSpec) -> concurrent.futures.Executor:
        if has_encoder_parts(spec):
            return self._fetching_builder  # its threads only wait (on the encoder): no turns needed
        if spec.structured is not None:
            # A chat's too (its template rendered there): compiled on the chat threads, a caller's 24
            # schemas of 49 KB held its plain chat 2-4.6 s, and with both threads compiling, every
            # other caller's chat waited for one (0.75 s).
            return self._structured_builder.for_caller(spec.caller)
        return (self._builder if spec.chat is None else self._chat_builder).for_caller(spec.caller)

    # -- LoRA adapters ---------------------------------------------------------------------------

    async def load_adapter(
        self,
        name: str,
        path: str | Path,
        shown: str | None = None,
        found: FoundAdapter | None = None,
    ) -> Adapter:
        """Read the PEFT adapter in directory `path` and serve it as `name`; requests already running
        go on undisturbed. `path` is opened as it is, unless `found` (a caller's, bound to --lora-root by
        AdapterRoot.find) says what to open from the root's descriptor, refusing a symlink on the way
        and any other file (read_adapter); `shown` is how it is reported and named in refusals, `path`
        by default. Raises FailedPrecondition (LoRA off), InvalidArgument (the name, or an adapter
        that does not fit: the file and field named), AlreadyExists, ResourceExhausted
        (every slot taken). Nothing is loaded when it raises, nor when its caller leaves before the
        install starts (the install is skipped); one that leaves later finds the adapter loaded."""
        if not self._thread.is_healthy:
            raise Unavailable("the decoder engine is not running")
        shown = str(path) if shown is None else shown
        reading = self._adapter_reader.submit(self._read_adapter, name, path, shown, found)
        adapter = await asyncio.wrap_future(reading)
        installing = self.core.between_steps(partial(self._install, name, shown, adapter))
        self._thread.wake()
        return await asyncio.wrap_future(installing)

    def _read_adapter(
        self,
        name: str,
        path: str | Path,
        shown: str | None = None,
        found: FoundAdapter | None = None,
    ) -> LoraAdapter:
        self.core.check_can_load(name)  # the cheap refusals before the files are read; ends nothing
        assert self.lora is not None
        return read_adapter(path, self.model_config, self.lora.max_rank, shown, found)

    def _install(self, name: str, shown: str, adapter: LoraAdapter) -> Adapter:
        """On the engine thread between steps, under the core's lock: a free slot gets the weights,
        then the name is published (a request can name it from then on)."""
        assert self.lora is not None and self.core.adapters is not None
        slots = self.core.adapters
        slots.check_new(name)  # again: another load of the name or slot may have won the race since
        slot = self.core.take_slot()  # the files read and checked: only now may paused streams end for it
        start = time.perf_counter()
        self.lora.write(slot, adapter)
        self.core.runner.slots_written()
        if self._peers is not None:  # every rank writes its shard before a step can name the slot
            try:
                self._peers.install_adapter(slot, adapter)
            except Exception as error:  # they would run the slot with other weights from now on
                raise EngineFault(f"the other ranks missed adapter {echo(name)}: {error}") from error
        loaded = slots.add(name, shown, adapter.rank, adapter.targets, slot)
        log.info(
            "adapter %s (rank %d, %s) in slot %d: %.1f ms to write",
            name,
            adapter.rank,
            "/".join(adapter.targets),
            slot,
            1000 * (time.perf_counter() - start),
        )
        return loaded

    def unload_adapter(self, name: str) -> int:
        """Stop serving adapter `name` (NotFound if not loaded); requests running with it finish with
        it, and its slot is free once they have. Returns how many there still are."""
        num_running = self.core.unload_adapter(name)
        self._thread.wake()  # its slot may be free at the next step
        return num_running

    @property
    def adapters(self) -> list[Adapter]:
        """The loaded adapters, by name."""
        return self.core.loaded_adapters()

    async def tokenize(self, texts: list[str], add_special_tokens: bool, caller: str = "") -> list[list[int]]:
        """Token IDs of each text, computed on the request-building thread (the GIL released), in
        `caller`'s turn (api/caller.py)."""
        work = self._builder.submit(
            caller, self.tokenizer.encode_batch, texts, add_special_tokens=add_special_tokens
        )
        return [encoding.ids for encoding in await asyncio.wrap_future(work)]


def _init_builder_thread() -> None:
    # One intra-op thread: a parallel op here would start a second OpenMP team, which slows the
    # engine thread's own ops (see loop.py); casting one request's rows needs no team.
    torch.set_num_threads(1)


def _prompt_logprobs_buffer(request: Request) -> PromptLogprobsBuffer | None:
    if request.sampling.prompt_logprobs is None:
        return None
    return PromptLogprobsBuffer(request.prompt_token_ids, request.is_token_ids)
