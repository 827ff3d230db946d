"""Accelerator backends: everything that differs between CPU, CUDA and AWS Neuron, in one table.

NOTE: the rule. Model code never asks which backend it runs on. What differs (where the weights and
the KV cache live, the default dtype, the data-plane collective backend, how a static-shape decode
bucket becomes a compiled graph, whether dynamic shapes are allowed at all) is a field of `Backend`
or a function here; the engine, the runner and `parallel.py` read it, nothing else does.

- cpu: the default and what every test runs. Compiled buckets go through `torch.compile`
  (Inductor, `dynamic=False`, one graph per bucket).
- cuda: NCCL between ranks, bf16 by default; compiled buckets use `mode="reduce-overhead"`, so
  Inductor captures each bucket as a CUDA graph (the KV cache is marked a static address so the
  graphs may write it in place).
- neuron: needs `torch-neuronx` (the AWS Neuron SDK, not on PyPI). Static shapes only; each decode
  bucket is traced ahead with `torch_neuronx.trace`. One rank only: Neuron tensor parallelism runs as
  one SPMD program (NxD), not as the per-rank processes this engine spawns.

Only the SDK-free parts run in this repository's tests; see the README's "Backends" section for
exactly what was and was not run on real hardware.
"""

from __future__ import annotations

import importlib
import logging
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from services.decoder.models import native

if TYPE_CHECKING:
    from services.decoder.models.transformer import DecoderModel

log = logging.getLogger(__name__)

CUDA_INSTALL = (
    "install a CUDA build of torch (e.g. `pip install torch --index-url "
    "https://download.pytorch.org/whl/cu126`) on a machine with an NVIDIA GPU and driver"
)
NEURON_INSTALL = (
    "install the AWS Neuron SDK (torch-neuronx), which is not on PyPI: on an Inf2/Trn1/Trn2 instance "
    "run `pip install torch-neuronx neuronx-cc --extra-index-url https://pip.repos.neuron.amazonaws.com` "
    "(see https://awsdocs-neuron.readthedocs-hosted.com for the driver and runtime)"
)


class BackendUnavailable(RuntimeError):
    """The requested backend cannot run in this process; the message says what to install."""


@dataclass(frozen=True)
class Backend:
    """One accelerator family, as the engine sees it."""

    name: str  # "cpu", "cuda" or "neuron": the --device value without a device index
    placement: str  # torch device type of the weights and KV cache ("cpu" for Neuron's traced graphs)
    default_dtype: str  # --dtype when none is given
    collective_backend: str | None  # torch.distributed data plane; None = one rank only
    compile_mode: str | None  # torch.compile mode of a decode bucket; None = traced by the SDK instead
    requires_static_shapes: bool  # True: every step must be padded to a warmed-up bucket
    uses_cuda_graphs: bool  # compiled buckets replay into reused output buffers (callers get a copy)
    install_hint: str  # what to install when `check_available` fails
    prepacks_weights: bool = False  # pack bf16 linear weights for oneDNN once at load (eager CPU)
    native_kernels: bool = False  # decode attention through models/native_kernels.c (eager CPU)
    compiler: str = "inductor"  # torch.compile backend; tests swap in "aot_eager" (same graphs, no codegen)


BACKENDS: dict[str, Backend] = {
    "cpu": Backend(
        name="cpu",
        placement="cpu",
        default_dtype="bfloat16",
        collective_backend="gloo",
        compile_mode="default",
        requires_static_shapes=False,
        uses_cuda_graphs=False,
        install_hint="",
        prepacks_weights=True,
        native_kernels=True,
    ),
    "cuda": Backend(
        name="cuda",
        placement="cuda",
        default_dtype="bfloat16",
        collective_backend="nccl",
        compile_mode="reduce-overhead",
        requires_static_shapes=False,
        uses_cuda_graphs=True,
        install_hint=CUDA_INSTALL,
    ),
    "neuron": Backend(
        name="neuron",
        placement="cpu",
        default_dtype="bfloat16",
        collective_backend=None,
        compile_mode=None,
        requires_static_shapes=True,
        uses_cuda_graphs=False,
        install_hint=NEURON_INSTALL,
    ),
}


def resolve(device: str) -> Backend:
    """The backend of a --device value ("cpu", "cuda", "cuda:1", "neuron"). Imports nothing.

    Raises ValueError naming the choices.
    """
    name, _, index = device.partition(":")
    backend = BACKENDS.get(name)
    if backend is None or (index and (name != "cuda" or not index.isdigit())):
        raise ValueError(f"device must be one of {', '.join(BACKENDS)} (or cuda:N), got {device!r}")
    return backend


def check_available(device: str) -> Backend:
    """Fails fast, before any weight is read, when this process cannot run `device`.

    Raises BackendUnavailable with what to install: a CPU-only torch for cuda, no torch_neuronx
    for neuron.
    """
    backend = resolve(device)
    if backend.name == "cuda" and not torch.cuda.is_available():
        built = torch.version.cuda or "none (a CPU-only build)"
        raise BackendUnavailable(
            f"--device {device}: torch {torch.__version__} sees no CUDA device (CUDA runtime: {built}); "
            f"{backend.install_hint}"
        )
    if backend.name == "cuda" and ":" in device and int(device.split(":")[1]) >= torch.cuda.device_count():
        raise BackendUnavailable(f"--device {device}: only {torch.cuda.device_count()} CUDA devices")
    if backend.name == "neuron":
        _import_neuron(device)
    return backend


def torch_device(device: str) -> torch.device:
    """Where the weights and the KV cache are allocated for a --device value."""
    backend = resolve(device)
    return torch.device(device if backend.placement == "cuda" else backend.placement)


def prepare_model(model: DecoderModel, backend: Backend, compile: bool, native_kernels: bool) -> None:
    """Readies a model this process loaded for serving on `backend`, on every rank alike.

    Eager CPU: bf16 weights packed for oneDNN and, unless `native_kernels` is off, the C kernels
    attached (None when they cannot be built: the model keeps torch ops). Compiled models stay as
    loaded: Inductor folds and packs weights itself. Call on the thread that runs the model.
    """
    if compile:
        return
    if backend.prepacks_weights:
        model.prepack()
    if backend.native_kernels and native_kernels:
        model.use_native_kernels(native.load())


def bind_rank_device(device: str) -> None:
    """Before joining a process group: NCCL needs the rank's CUDA device to be the current one."""
    if resolve(device).name == "cuda":
        torch.cuda.set_device(torch.device(device))


def _import_neuron(device: str):  # -> the torch_neuronx module
    try:
        return importlib.import_module("torch_neuronx")
    except ImportError as exc:
        raise BackendUnavailable(f"--device {device} needs torch_neuronx ({exc}); {NEURON_INSTALL}") from exc


# -- compiled decode buckets -----------------------------------------------------------------------

# A decode step as the runner calls it: (input_ids, positions, attn, kv_caches, inputs_embeds,
# is_token_ids) -> float32 logits [num_seqs, vocab]. The model itself is one.
StepFn = Callable[..., torch.Tensor]


class RecompileError(RuntimeError):
    """A compiled decode bucket was asked to compile again after warmup (a shape or guard changed)."""


def _inductor_mode_options(mode: str) -> dict[str, object]:
    from torch._inductor import list_mode_options

    return dict(list_mode_options(mode))


def _call_model(model: torch.nn.Module, *args: object) -> torch.Tensor:
    return model(*args)


class TorchCompileBuckets:
    """CPU and CUDA: `torch.compile(model, dynamic=False, fullgraph=True)`, one graph per bucket.

    Dynamo keeps one cache entry per input signature of the compiled function, so one compiled
    callable serves every bucket; `num_graphs` counts what the backend compiled. Dynamo's cache
    hangs off a code object, so each instance compiles a private copy of `_call_model`: two
    runners (or two engines in one test session) never share entries or a recompile limit. After
    `seal()` (warmup done) any further compile raises instead of silently stalling a step: the call
    runs under `fail_on_recompile`, and the counting backend refuses too.
    """

    def __init__(
        self,
        backend: Backend,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],  # per layer; written in place by every step
        max_num_buckets: int,
    ) -> None:
        self.mode = backend.compile_mode or "default"
        self.compile_backend = backend.compiler
        self.inductor_options = _inductor_mode_options(self.mode)
        self.max_num_buckets = max_num_buckets
        self.num_graphs = 0  # graphs compiled so far (one per bucket when fullgraph holds)
        self.compile_s = 0.0  # seconds spent inside the compiler backend
        self.num_calls = 0  # steps run through the compiled graphs, warmup included
        self.is_sealed = False
        self.copies_output = backend.uses_cuda_graphs
        for cache in kv_caches:  # CUDA graphs may then mutate them in place; a no-op elsewhere
            torch._dynamo.mark_static_address(cache)
        step = types.FunctionType(_call_model.__code__.replace(), _call_model.__globals__, "decode_step")
        self.model = model
        self.compiled = torch.compile(step, backend=self._compile_graph, dynamic=False, fullgraph=True)

    def bucket(self) -> StepFn:
        """The step function of one more decode bucket (compiled on its first call, at warmup)."""
        return self._run

    def seal(self) -> None:
        self.is_sealed = True

    def _run(self, *args: object) -> torch.Tensor:
        self.num_calls += 1
        if self.is_sealed:
            with torch.compiler.set_stance("fail_on_recompile"):
                out = self.compiled(self.model, *args)
        else:
            # Every bucket is a new cache entry of the same code object: lift dynamo's default limit.
            limit = max(torch._dynamo.config.recompile_limit, self.max_num_buckets)
            with torch._dynamo.config.patch(recompile_limit=limit):
                out = self.compiled(self.model, *args)
        return out.clone() if self.copies_output else out

    def _compile_graph(self, gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):
        if self.is_sealed:
            raise RecompileError("a compiled decode bucket recompiled after warmup")
        start = time.perf_counter()
        if self.compile_backend == "inductor":
            from torch._inductor.compile_fx import compile_fx

            compiled = compile_fx(gm, example_inputs, config_patches=self.inductor_options)
        else:
            compiled = torch._dynamo.lookup_backend(self.compile_backend)(gm, example_inputs)
        self.num_graphs += 1
        self.compile_s += time.perf_counter() - start
        return compiled


class NeuronTracedBuckets:
    """Neuron: one `torch_neuronx.trace` graph per decode bucket, built at warmup.

    NOT RUN in this repository (no Neuron SDK or device was available); reachable only when
    torch_neuronx imports. The traced graph takes tensors only, so the bucket's host-side
    attention lists are rebuilt inside (a decode bucket has one query per sequence, and the decode
    attention reads lengths from `seq_lens_t` only). The graph returns the written KV caches, which
    are copied back into the engine's cache: a deployment that keeps the cache on the device needs
    NxD's input/output aliasing instead, which this class does not do.
    """

    def __init__(self, backend: Backend, model: torch.nn.Module, kv_caches: list[torch.Tensor]) -> None:
        self.neuronx = _import_neuron(backend.name)
        self.model = model
        self.kv_caches = kv_caches
        self.num_graphs = 0
        self.compile_s = 0.0
        self.num_calls = 0
        self.is_sealed = False
        self._graphs: dict[tuple[int, int], Callable[..., tuple[torch.Tensor, ...]]] = {}

    def bucket(self) -> StepFn:
        return self._run

    def seal(self) -> None:
        self.is_sealed = True

    def _run(self, input_ids, positions, attn, kv_caches, inputs_embeds, is_token_ids) -> torch.Tensor:
        from services.decoder.models.attention import AttentionMetadata

        num_seqs = len(attn.query_lens)
        key = (num_seqs, attn.block_tables.shape[1])
        tensors = (
            input_ids,
            positions,
            attn.cu_query_lens,
            attn.seq_lens_t,
            attn.slot_mapping,
            attn.block_tables,
            attn.logits_indices,
            inputs_embeds,
            is_token_ids,
        )
        self.num_calls += 1
        graph = self._graphs.get(key)
        if graph is None:
            if self.is_sealed:
                raise RecompileError(f"decode bucket {key} was not traced at warmup")
            model = self.model

            def step(ids, pos, cu, lens, slots, tables, rows, embeds, is_token, *caches):
                meta = AttentionMetadata(
                    query_lens=[1] * num_seqs,
                    seq_lens=[1] * num_seqs,  # placeholders: decode attention reads seq_lens_t
                    cu_query_lens=cu,
                    seq_lens_t=lens,
                    slot_mapping=slots,
                    block_tables=tables,
                    logits_indices=rows,
                )
                logits = model(ids, pos, meta, list(caches), embeds, is_token)
                return (logits, *caches)

            start = time.perf_counter()
            graph = self._graphs[key] = self.neuronx.trace(step, (*tensors, *kv_caches))
            self.num_graphs += 1
            self.compile_s += time.perf_counter() - start
        logits, *written = graph(*tensors, *kv_caches)
        for cache, new in zip(kv_caches, written, strict=True):
            cache.copy_(new)
        return logits


BucketCompiler = TorchCompileBuckets | NeuronTracedBuckets


def bucket_compiler(
    backend: Backend, model: torch.nn.Module, kv_caches: list[torch.Tensor], max_num_buckets: int
) -> BucketCompiler:
    """How this backend turns each static-shape decode bucket into a compiled graph."""
    if backend.compile_mode is None:
        return NeuronTracedBuckets(backend, model, kv_caches)
    return TorchCompileBuckets(backend, model, kv_caches, max_num_buckets)
