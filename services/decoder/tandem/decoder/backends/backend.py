"""Accelerator backends: everything that differs between CPU, CUDA and AWS Neuron, in one table.

NOTE: the rule. Model code never asks which backend it runs on. What differs (where the weights and
the KV cache live, the default dtype, the data-plane collective backend, how a static-shape decode
bucket becomes a compiled graph, whether dynamic shapes are allowed at all) is a field of `Backend`
or a function here; the engine, the runner and `distributed/parallel.py` read it, nothing else does.
How a CPU or CUDA decode bucket becomes a graph is `torch_compile.py`; the Neuron backend is its own
package, `xla/`.

- cpu: the default and what every test runs. Compiled buckets go through `torch.compile`
  (Inductor, `dynamic=False`, one graph per bucket).
- cuda: NCCL between ranks, bf16 by default; attention through FlexAttention over the paged cache
  (`cuda_attention.py`); compiled buckets use `mode="reduce-overhead"`, so Inductor captures each
  bucket as a CUDA graph (the KV cache is marked a static address so the graphs may write it in
  place).
- neuron: an XLA device (torch-neuronx is torch_xla's PJRT plugin for NeuronCores; `xla/runtime.py`).
  Weights and the KV cache live on the device; every step is a static-shape graph compiled at
  warmup (`engine/step/xla_runner.py`); several devices are one SPMD program in one process, sharded by
  annotations (`xla/sharding.py`), not the per-rank processes this engine spawns for CPU and CUDA.
  Without the Neuron SDK the same graphs run on XLA's CPU device (PJRT_DEVICE=CPU): every test here.
  docs/BACKENDS.md says exactly what ran where.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from tandem.client.errors import ConfigError
from tandem.decoder.backends.cpu import executor as cpu_executor
from tandem.decoder.backends.cpu.kernel_options import KernelOptions
from tandem.decoder.backends.cuda_attention import CudaPagedAttention
from tandem.decoder.backends.xla import runtime as xla_runtime
from tandem.decoder.backends.xla.attention import XlaPagedAttention
from tandem.decoder.models.attention import PagedAttention
from tandem.decoder.models.forward_batch import ForwardBatch
from tandem.decoder.models.lora import LoraTable
from tandem.decoder.models.transformer import DecoderModel

log = logging.getLogger(__name__)

CUDA_INSTALL = (
    "install a CUDA build of torch (e.g. `pip install torch --index-url "
    "https://download.pytorch.org/whl/cu126`) on a machine with an NVIDIA GPU and driver"
)


class BackendUnavailable(RuntimeError):
    """The requested backend cannot run in this process; the message says what to install."""


@dataclass(frozen=True)
class Backend:
    """One accelerator family, as the engine sees it."""

    name: str  # "cpu", "cuda" or "neuron": the --device value without a device index
    placement: str  # torch device type of the weights and KV cache
    default_dtype: str  # --dtype when none is given
    collective_backend: str | None  # torch.distributed data plane; None = no process group
    compile_mode: str | None  # torch.compile mode of a decode bucket; None = not torch.compile (XLA)
    requires_static_shapes: bool  # True: every step must be padded to a warmed-up bucket
    uses_cuda_graphs: bool  # compiled buckets replay into reused output buffers (callers get a copy)
    install_hint: str  # what to install when `check_available` fails
    has_cpu_executor: bool = False  # eager steps run through backends/cpu/executor.py's bound kernels
    # EngineConfig.shared_step_seqs when not given: where a step's time grows with its rows (a CPU:
    # attention over each row's context), a neighbour beside a flood is served at a narrow step's
    # pace; an accelerator's wide step costs little more than a narrow one, so 0 (off).
    shared_step_seqs: int = 0
    compiler: str = "inductor"  # torch.compile backend; tests swap in "aot_eager" (same graphs, no codegen)
    # The model's attention implementation; None keeps the model's own (torch ops; the CPU executor
    # plugs in its C decode kernel).
    attention: type[PagedAttention] | None = None
    # Several devices are one SPMD program in this process (XLA), not one process per rank: the model
    # loads whole and `--world-size` counts devices (EngineConfig.num_devices).
    is_spmd: bool = False
    # Flags left unset take these where the backend needs its own (else EngineConfig's defaults): a
    # static-shape backend compiles a graph per bucket, and the buckets grow with these limits.
    default_limits: tuple[tuple[str, int], ...] = ()


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
        has_cpu_executor=True,
        shared_step_seqs=8,
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
        attention=CudaPagedAttention,
    ),
    "neuron": Backend(
        name="neuron",
        placement="xla",
        default_dtype="bfloat16",
        collective_backend=None,
        compile_mode=None,
        requires_static_shapes=True,
        uses_cuda_graphs=False,
        install_hint=xla_runtime.XLA_INSTALL,
        attention=XlaPagedAttention,
        is_spmd=True,
        # 16 decode graphs (1-8 rows x widths 4-128 blocks) and 11 prefill graphs (16-128 positions)
        # for a 2,048-position context, as NxD Inference's default buckets are few: every graph is a
        # compile at start.
        default_limits=(("max_num_seqs", 8), ("max_num_batched_tokens", 128), ("max_model_len", 2048)),
    ),
}


def resolve(device: str) -> Backend:
    """The backend of a --device value ("cpu", "cuda", "cuda:1", "neuron"). Imports nothing.

    Raises ConfigError naming the choices.
    """
    name, _, index = device.partition(":")
    backend = BACKENDS.get(name)
    if backend is None or (index and (name != "cuda" or not index.isdigit())):
        raise ConfigError("device", f"must be one of {', '.join(BACKENDS)} (or cuda:N), got {device!r}")
    return backend


def check_available(device: str) -> Backend:
    """Fails fast, before any weight is read, when this process cannot run `device`.

    Raises BackendUnavailable with what to install: a CPU-only torch for cuda, no torch_xla for
    neuron. Starts nothing (the XLA runtime starts in `start_device`).
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
    if backend.placement == "xla" and not xla_runtime.is_installed():
        raise BackendUnavailable(f"--device {device}: {xla_runtime.XLA_INSTALL}")
    return backend


def start_device(device: str, num_devices: int = 1) -> torch.device:
    """Where the weights and the KV cache are allocated for a --device value. For an XLA backend this
    starts its runtime over `num_devices` devices (once per process, before any tensor goes there).

    Raises BackendUnavailable when the XLA runtime cannot start.
    """
    backend = resolve(device)
    if backend.placement == "xla":
        try:
            xla_runtime.start(num_devices)
            return xla_runtime.device()
        except xla_runtime.XlaUnavailable as error:
            raise BackendUnavailable(f"--device {device}: {error}") from None
    return torch.device(device if backend.placement == "cuda" else backend.placement)


class ModelStep(Protocol):
    """What runs a model's steps: the model itself, or an executor bound to it (the CPU's)."""

    def __call__(
        self,
        batch: ForwardBatch,  # the step's packed inputs, its rows' LoRA adapters included
        kv_caches: list[torch.Tensor],  # per layer [2, num_blocks, block_size, num_kv_heads, head_dim]
    ) -> torch.Tensor: ...  # float32 logits [num_logits, vocab_size]

    def hidden_states(
        self, batch: ForwardBatch, kv_caches: list[torch.Tensor]
    ) -> torch.Tensor: ...  # [num_logits, hidden_size]

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor: ...  # float32 [num_rows, vocab_size]

    def argmax(self, logits: torch.Tensor) -> torch.Tensor: ...  # int64 [num_rows] of [num_rows, vocab]


def prepare_model(
    model: DecoderModel,
    backend: Backend,
    compile: bool,
    native_kernels: bool,
    kernel_options: KernelOptions | None = None,  # EngineConfig.kernel_options; None: chosen by the flags
    lora: LoraTable | None = None,  # LoRA slots the CPU executor binds (models/lora.py); None: off
) -> ModelStep:
    """What runs a model this process loaded on `backend`, on every rank alike.

    The backend's attention implementation, if it has one. Eager CPU: the CPU executor, its kernels
    chosen by measurement on this CPU as `kernel_options` say (the C kernels' builds, when installed:
    else one log line and torch ops). `native_kernels` off, or compiled mode: the plain model
    (Inductor generates its own kernels and packs weights itself). Call on the thread that runs the model.
    """
    if backend.attention is not None:
        model.use_attention(backend.attention())
    if not backend.has_cpu_executor:
        return model
    if compile:
        log.info("CPU kernels: not used in compiled mode (Inductor generates its own)")
        return model
    if not native_kernels:
        log.info("CPU kernels: off (--native-kernels false), the model runs on torch ops")
        return model
    return cpu_executor.bind(model, kernel_options, lora)


def bind_rank_device(device: str) -> None:
    """Before joining a process group: NCCL needs the rank's CUDA device to be the current one."""
    if resolve(device).name == "cuda":
        torch.cuda.set_device(torch.device(device))


# -- compiled decode buckets (torch_compile.py) --

# A decode step as the runner calls it: (batch: ForwardBatch, kv_caches) -> float32 logits
# [num_seqs, vocab]. The model itself is one.
StepFn = Callable[..., torch.Tensor]


class RecompileError(RuntimeError):
    """A compiled decode bucket was asked to compile again after warmup (a shape or guard changed)."""
