"""The engine: a model, its KV pool and scheduler, stepped on a thread of its own.

Fronts: `generate()` for in-process use (a blocking iterator of events) and `stream()` for the
asyncio servicer (an async iterator; cancelling it aborts the request). Events cross from the
engine thread to the event loop with `call_soon_threadsafe`, one call per event, so the loop never
waits on a lock held across a forward pass.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import TypeVar

import torch

from common.errors import Unavailable
from services.decoder.backends import backend as backends
from services.decoder.config import EngineConfig
from services.decoder.distributed.parallel import ParallelContext
from services.decoder.distributed.step_broadcast import StepSender
from services.decoder.engine.core import EngineCore, Sink
from services.decoder.engine.kv_cache import BlockManager
from services.decoder.engine.mailbox import LoopMailbox
from services.decoder.engine.outputs import Delta, Event, Failed, Finished, OutputState
from services.decoder.engine.prompt import GenerateSpec, build_request
from services.decoder.engine.request import Request
from services.decoder.engine.runner import ModelRunner
from services.decoder.engine.scheduler import Scheduler, SchedulerConfig
from services.decoder.engine.static_shapes import StaticShapes, power_of_two_buckets
from services.decoder.models.config import ModelConfig
from services.decoder.models.loader import LoadedModel, load_model
from services.decoder.models.tensor_parallel import world_size_of

log = logging.getLogger(__name__)


class Engine:
    """With `tp` (several ranks) this is rank 0: it feeds every step to the others' worker loops."""

    def __init__(
        self,
        config: EngineConfig,
        loaded: LoadedModel | None = None,
        tp: ParallelContext | None = None,
        backend: backends.Backend | None = None,  # None: config.device's; tests may swap the compiler
    ) -> None:
        self.config = config
        backend = backend or backends.check_available(config.device)
        # Every torch op of the engine (loading, KV allocation, warmup, steps) runs on this one thread.
        # On CPU a second thread that once ran a parallel torch op keeps an OpenMP team that slows
        # the stepping thread's ops by ~50% (measured: 8 ms -> 12 ms per bench-small decode step).
        num_threads = config.num_threads or torch.get_num_threads()
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="tandem-engine",
            initializer=_init_engine_thread,
            initargs=(num_threads,),
        )
        self._loop_done: concurrent.futures.Future[None] | None = None  # set by start()
        device = backends.torch_device(config.device)
        try:
            self.loaded = loaded or self._on_engine_thread(
                load_model, config.model_dir, config.dtype, device, tp
            )
        except BaseException:
            self._executor.shutdown()
            raise
        if loaded is None:  # a caller's model stays as given
            self._on_engine_thread(
                backends.prepare_model, self.loaded.model, backend, config.compile, config.native_kernels
            )
        model_config = self.loaded.config
        self.model_config = model_config
        self.tokenizer = self.loaded.tokenizer
        self.max_model_len = min(
            config.max_model_len or model_config.max_position_embeddings, model_config.max_position_embeddings
        )
        self.eos_token_ids = frozenset(model_config.eos_token_ids)
        self.num_blocks = num_kv_blocks(config, model_config, world_size_of(tp))
        block_manager = BlockManager(self.num_blocks, config.block_size, config.enable_prefix_caching)
        scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                max_waiting=config.max_queue,
            ),
            block_manager,
        )
        sink = None if tp is None else StepSender(tp.control)
        runner = self._on_engine_thread(
            ModelRunner,
            self.loaded.model,
            self.num_blocks,
            config.block_size,
            self._static_shapes(),
            sink,
            backend if config.compile else None,
        )
        # Idle rank 0 sends keepalives well within the group timeout; one rank just sleeps.
        self._keepalive_s = None if tp is None else tp.timeout_s / 4
        self.core = EngineCore(scheduler, runner, model_config.vocab_size)
        self._wakeup = threading.Condition()
        self._running = False
        self._error: Exception | None = None
        self._ids = itertools.count()
        self._mailboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopMailbox] = (
            weakref.WeakKeyDictionary()
        )
        self._mailboxes_lock = threading.Lock()

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> Engine:
        if self.config.static_shapes:
            self._on_engine_thread(self.warmup)
        self._running = True
        self._loop_done = self._executor.submit(self._loop)
        return self

    def _on_engine_thread(self, fn: Callable[..., T], *args: object) -> T:
        """Run `fn` on the engine thread and wait for it: set-up only, before the loop takes the thread."""
        if self._loop_done is not None:
            raise RuntimeError("the engine loop owns the engine thread: set-up calls come before start()")
        return self._executor.submit(fn, *args).result()

    def shutdown(self) -> None:
        """Stop the loop; requests still open end with UNAVAILABLE."""
        with self._wakeup:
            self._running = False
            self._wakeup.notify()
        if self._loop_done is not None:
            self._loop_done.result()
        self._executor.shutdown()
        self.core.fail_all(Unavailable("the decoder is shutting down"))
        if self.core.runner.sink is not None and self._error is None:
            try:
                self.core.runner.sink.stop()  # the other ranks' worker loops end
            except Exception:  # a rank already gone: it has nothing left to stop
                log.exception("could not tell the other ranks to stop")

    @property
    def is_healthy(self) -> bool:
        return self._running and self._error is None

    def __enter__(self) -> Engine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- requests --------------------------------------------------------------------------------

    def submit(self, spec: GenerateSpec, sink: Sink) -> str:
        """Validate and admit; events go to `sink` on the engine thread. Returns the request id."""
        if self._error is not None or not self._running:
            raise Unavailable("the decoder engine is not running")
        request = self.make_request(spec)
        output = OutputState(
            request.request_id,
            request.prompt_token_ids,
            request.stopping,
            spec.output,
            self.tokenizer,
            self.eos_token_ids,
            self.max_model_len,
            request.arrival_time,
        )
        self.core.add(request, output, sink, spec.deadline)
        with self._wakeup:
            self._wakeup.notify()
        return request.request_id

    def abort(self, request_id: str) -> None:
        self.core.abort(request_id)
        with self._wakeup:
            self._wakeup.notify()

    def generate(self, spec: GenerateSpec) -> Iterator[Event]:
        """In-process API: yields Accepted, Delta*, then Finished or Failed."""
        events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        request_id = self.submit(spec, events.put)
        finished = False
        try:
            while True:
                event = events.get()
                yield event
                if isinstance(event, Finished | Failed):
                    finished = True
                    return
        finally:
            # Only an unfinished request is aborted: its id may be reused as soon as it finished.
            if not finished:
                self.abort(request_id)

    async def stream(self, spec: GenerateSpec) -> AsyncIterator[Event]:
        """asyncio front: the same events; leaving early (cancel, error) aborts the request.

        A consumer that falls behind gets the deltas that piled up as one (vLLM's output collector
        does the same): every message costs the server CPU the model needs, so a slow stream sends
        fewer, fuller messages instead of a growing backlog.
        """
        mailbox = self._mailbox(asyncio.get_running_loop())
        events: asyncio.Queue[Event] = asyncio.Queue()

        def sink(event: Event) -> None:
            mailbox.post(events, event)

        request_id = self.submit(spec, sink)
        finished = False
        held: Event | None = None  # taken from the queue while merging, not yet yielded
        try:
            while True:
                if held is not None:
                    event, held = held, None
                else:
                    event = await events.get()
                while isinstance(event, Delta) and not events.empty():
                    later = events.get_nowait()
                    if not isinstance(later, Delta):
                        held = later
                        break
                    event = event.followed_by(later)
                yield event
                if isinstance(event, Finished | Failed):
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def _mailbox(self, loop: asyncio.AbstractEventLoop) -> LoopMailbox:
        """One mailbox per event loop, shared by all of that loop's streams."""
        with self._mailboxes_lock:
            mailbox = self._mailboxes.get(loop)
            if mailbox is None:
                mailbox = self._mailboxes[loop] = LoopMailbox(loop)
            return mailbox

    def make_request(self, spec: GenerateSpec) -> Request:
        """Flatten and validate a spec against this engine's model; raises InvalidArgument."""
        return build_request(
            spec,
            spec.request_id or f"req-{next(self._ids)}",
            self.tokenizer,
            self.model_config,
            self.max_model_len,
            self.config.enable_prompt_embeds,
        )

    # -- the loop --------------------------------------------------------------------------------

    def _loop(self) -> None:
        sink = self.core.runner.sink
        while True:
            with self._wakeup:
                if self._running and not self.core.has_work():
                    self._wakeup.wait(self._keepalive_s)
                if not self._running:
                    return
            try:
                if self.core.has_work():
                    self.core.step()
                elif sink is not None:
                    sink.keepalive()
            except Exception as exc:  # a fault in the model or the engine: fail loudly, never hang
                log.exception("engine step failed; failing every open request")
                self._error = exc
                self._running = False
                self.core.fail_all(Unavailable(f"the decoder engine failed: {type(exc).__name__}"))
                return

    def warmup(self) -> None:
        """Static mode: run every (tokens, seqs) bucket once with dummy inputs so no shape is new later."""
        runner = self.core.runner
        assert runner.static is not None
        for num_seqs in runner.static.seq_buckets:
            for num_tokens in runner.static.token_buckets:
                if num_tokens < num_seqs:
                    continue
                runner.warmup(num_tokens, num_seqs)
        runner.seal()
        if runner.compiler is not None:
            log.info(
                "compiled %d decode buckets (%d graphs) in %.1f s",
                len(runner.compiled_steps),
                runner.compiler.num_graphs,
                runner.compiler.compile_s,
            )

    def _static_shapes(self) -> StaticShapes | None:
        config = self.config
        if not config.static_shapes:
            return None
        # One spare sequence bucket: padding tokens need a padding sequence to live in, and each
        # padding sequence holds at least one token on top of the real ones.
        seq_buckets = config.seq_buckets or power_of_two_buckets(config.max_num_seqs + 1)
        token_buckets = config.token_buckets or power_of_two_buckets(
            config.max_num_batched_tokens + seq_buckets[-1]
        )
        if token_buckets[-1] < config.max_num_batched_tokens + seq_buckets[-1]:
            raise ValueError(
                "the largest token bucket must hold max_num_batched_tokens plus the largest seq bucket"
            )
        return StaticShapes(
            token_buckets=token_buckets,
            seq_buckets=seq_buckets,
            block_table_width=-(-self.max_model_len // config.block_size),
        )


def num_kv_blocks(config: EngineConfig, model_config: ModelConfig, world_size: int) -> int:
    """KV blocks in the pool: config.num_kv_blocks, or as many as fit in kv_cache_bytes on each rank.

    Every rank computes the same count (each holds num_kv_heads / world_size heads of every block).
    """
    if config.num_kv_blocks:
        return config.num_kv_blocks
    c = model_config
    num_kv_heads = c.num_kv_heads // world_size
    per_block = 2 * c.num_layers * config.block_size * num_kv_heads * c.head_dim * c.dtype.itemsize
    return max(2, config.kv_cache_bytes // per_block + 1)  # + the reserved null block


T = TypeVar("T")


def _init_engine_thread(num_threads: int) -> None:
    # The intra-op thread count is per thread: set it where the work runs.
    torch.set_num_threads(num_threads)
    torch.set_grad_enabled(False)


def default_model_dir() -> Path:
    """Where the embedded default model lives when no --model is given."""
    return Path.home() / ".cache" / "tandem" / "models" / "tandem-tiny"
