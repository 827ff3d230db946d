"""The engine: a model, its KV pool and scheduler, stepped on a thread of its own (`loop.py`).

Fronts: `generate()` for in-process use (a blocking iterator of events) and `stream()` for the
asyncio servicer (an async iterator, `streaming.py`; cancelling it aborts the request). Sizes derived
from the config and the model (context, KV blocks, buckets) are computed in `step/sizing.py`.

The parts it holds: the core, built from the config by `core_assembly.py`; the threads requests are
built on, and which builds each (`request_builders.py`); LoRA adapters loaded while it serves
(`adapter_loading.py`); and, as rank 0 of several, the other ranks at start and end (`peers.py`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import torch

from tandem.client.errors import Unavailable
from tandem.common import text_bounds
from tandem.decoder.backends import backend as backends
from tandem.decoder.config import EngineConfig
from tandem.decoder.engine.admission.chat import ChatTemplate
from tandem.decoder.engine.admission.prompt import GenerateSpec, build_request, check_spec
from tandem.decoder.engine.admission.prompt_logprob_budget import PromptLogprobBudget, num_entries
from tandem.decoder.engine.admission.prompt_logprob_size import PromptLogprobSize
from tandem.decoder.engine.front.adapter_loading import AdapterLoader
from tandem.decoder.engine.front.core_assembly import build_core, check_xla_host_pool
from tandem.decoder.engine.front.loop import EngineThread
from tandem.decoder.engine.front.peers import RankGroup, RankZeroPeers
from tandem.decoder.engine.front.request_builders import RequestBuilders
from tandem.decoder.engine.front.streaming import Mailboxes, stream_events
from tandem.decoder.engine.outputs.backpressure import ReaderProgress, unread_weight
from tandem.decoder.engine.outputs.outputs import Delta, Event, Failed, Finished, FinishReason, OutputState
from tandem.decoder.engine.outputs.prompt_logprobs import PromptLogprobsBuffer
from tandem.decoder.engine.outputs.token_bytes import token_bytes_table
from tandem.decoder.engine.request import Request
from tandem.decoder.engine.sampling.structured import GrammarCompiler
from tandem.decoder.engine.scheduling.adapters import Adapter
from tandem.decoder.engine.step import sizing
from tandem.decoder.engine.step.core import EventCallback
from tandem.decoder.models.adapter_root import AdapterRoot
from tandem.decoder.models.loader import LoadedModel, load_model, read_model_config
from tandem.decoder.models.lora import LoraTable
from tandem.decoder.models.peft_adapter import FoundAdapter
from tandem.decoder.models.tensor_parallel import world_size_of

log = logging.getLogger(__name__)


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
        # Requests are built off the event loop, on threads by kind of work (request_builders.py).
        self._builders = RequestBuilders()
        self._adapter_loader: AdapterLoader | None = None  # made with the core, which it installs through
        # Idle rank 0 sends keepalives well within the group timeout; one rank just sleeps.
        self._keepalive_s = None if tp is None else tp.timeout_s / 4
        self._keys = itertools.count()  # the engine's own request keys (see submit)
        self._mailboxes = Mailboxes()
        # Rank 0 of several: the other ranks, which run every step and adapter install too (peers.py).
        self._peers = RankZeroPeers(tp)
        # The rest holds memory, the threads above and the chat template's worker processes: a set-up
        # that fails part way releases what it made (a refused KV pool left the engine thread waiting
        # and the template's workers running in the caller's process; a --lora that could not be read
        # called shutdown() on builder threads not made yet, an AttributeError in its error's place).
        try:
            self._set_up(loaded, tp, backend)
        except BaseException:
            self._peers.set_up_failed(self._thread)
            self._close(failed=True)
            raise

    def _set_up(self, loaded: LoadedModel | None, tp: RankGroup | None, backend: backends.Backend) -> None:
        """The model, its executor, the chat template, the KV pool and the core; then --lora's adapters."""
        config = self.config
        if backend.placement == "xla":  # from config.json's numbers: a refusal at once, before the load
            check_xla_host_pool(
                config,
                loaded.config if loaded is not None else read_model_config(config.model_dir, config.dtype),
                tp,
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
        self.core = build_core(
            config,
            self.loaded,
            executor=self.executor,
            lora=self.lora,
            num_blocks=self.num_blocks,
            max_model_len=self.max_model_len,
            backend=backend,
            thread=self._thread,
            peers=self._peers,
        )
        loader = AdapterLoader(self.core, self.lora, self.model_config, self._peers.feed, self._thread)
        self._adapter_loader = loader
        loader.load_at_start(config.loras, self.adapter_root)  # --lora's, each into its slot before serving

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
        self._builders.shutdown()
        if self._adapter_loader is not None:  # None: a set-up that failed before the core was built
            self._adapter_loader.shutdown()
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
        self._peers.stop(failed)

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
            self._builders.for_spec(spec),
            progress,
        )

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
        assert self._adapter_loader is not None  # built with the core
        return await self._adapter_loader.load(name, path, shown, found)

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
        work = self._builders.plain.submit(
            caller, self.tokenizer.encode_batch, texts, add_special_tokens=add_special_tokens
        )
        return [encoding.ids for encoding in await asyncio.wrap_future(work)]


def _prompt_logprobs_buffer(request: Request) -> PromptLogprobsBuffer | None:
    if request.sampling.prompt_logprobs is None:
        return None
    return PromptLogprobsBuffer(request.prompt_token_ids, request.is_token_ids)
