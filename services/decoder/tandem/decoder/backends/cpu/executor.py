"""The CPU step executor: binds a loaded model's weights to the fastest kernels once, then runs its steps.

NOTE: the rule. The model (models/) is plain torch and stays the reference, and its forward is the
only walk over the layers: what makes it fast on a CPU is a `ModelKernels` (models/kernels.py) the
executor builds here, once, from the CPU's flags and the model's dtype, logs (`KernelChoice.describe`)
and passes to every step; the model's modules call what is bound for them. Per step only the step's
own kind is looked at:

- a decode-only step, with every layer fused: the one-call decode stack (`stack.py`), the walk
  kernel (`walk.py`);
- any other step, with every layer fused: each layer's fused kernel, the two C halves (`layer.py`)
  around the layer's attention call;
- otherwise each module op by op on its chosen kernel (`layer_kernels.py`): the linears bound once
  (`linear.py`: oneDNN's packed bf16, the C kernel or F.linear), the norms and the q/k norm + RoPE +
  KV write as C custom ops (`ops.py`) when a build is loaded, torch ops otherwise.

Layers fuse when the linears are on the C kernel (wherever a build is loaded, measured plan or
not), there is one rank, and the weights are bf16. Attention is always
`CpuPagedAttention` when a build is loaded (the C decode kernel in front of torch ops; the tiled
kernel at any context length on AVX512-BF16 builds), plugged in through the model's PagedAttention
interface so the plain model's forward uses it too. Every path keeps each row's sums in one order
whatever the number of rows, so a row's bits never depend on its neighbours.

LoRA slots (models/lora.py) change none of that: the fused halves and the stack add each adapted row's
delta after each projection in C (`lora.py`, csrc/lora.c), and the per-op path adds it after each
bound linear (the C kernel when a build is loaded, the torch reference otherwise). A step without an
adapted row runs exactly the plain calls, so a base row's bits are the same with LoRA on or off.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import torch

from tandem.common.torch_part.quantized_tensor import QuantizedTensor
from tandem.decoder.backends.cpu import int8_tile_choice, kernel_choice
from tandem.decoder.backends.cpu.attention import CpuPagedAttention
from tandem.decoder.backends.cpu.int8_tile_choice import Int8TilePlan
from tandem.decoder.backends.cpu.isa import CpuInfo, this_cpu
from tandem.decoder.backends.cpu.kernel_options import KernelOptions
from tandem.decoder.backends.cpu.kernels import DTYPE_CODES, Kernels, load_for_cpu
from tandem.decoder.backends.cpu.layer import FusedLayer, LayerWeights
from tandem.decoder.backends.cpu.layer_kernels import c_deltas, per_op
from tandem.decoder.backends.cpu.limits import fits
from tandem.decoder.backends.cpu.linear import (
    CLinear,
    KernelLinear,
    PackedLinear,
    QuantLinear,
    TorchLinear,
    can_bind,
    can_prepack,
)
from tandem.decoder.backends.cpu.linear_plan import LinearPlan
from tandem.decoder.backends.cpu.lora import LayerCLora, bind_table
from tandem.decoder.backends.cpu.ops import register
from tandem.decoder.backends.cpu.stack import DecodeStack
from tandem.decoder.backends.cpu.walk import CpuWalk
from tandem.decoder.models.forward_batch import ForwardBatch
from tandem.decoder.models.kernels import LayerKernels, ModelKernels
from tandem.decoder.models.layers import RMSNorm
from tandem.decoder.models.linear import Linear, Projection
from tandem.decoder.models.lora import LoraTable
from tandem.decoder.models.quantized import QuantizedEmbedding, QuantizedLinear
from tandem.decoder.models.transformer import DecoderLayer, DecoderModel

log = logging.getLogger(__name__)

LinearKind = Literal["c", "onednn", "torch"]
BoundLinear = CLinear | PackedLinear | TorchLinear | QuantLinear | KernelLinear
Shape = tuple[int, int]  # a weight's [out_features, in_features]
QUANTIZED_MODULES = (QuantizedLinear, QuantizedEmbedding)


@dataclass(frozen=True)
class KernelChoice:
    """What the executor bound, decided once; logged at load and readable by tests and benchmarks."""

    cpu: str  # the CPU's model name
    isa: str  # the flags that decided (CpuInfo.isa_summary)
    build: str | None  # the C kernels' build level ("avx512bf16", "avx2", "x86_64", ...); None = none loaded
    linears: LinearKind  # what runs the projections and the LM head
    fused_layers: bool  # every layer in two fused C halves around attention
    decode_stack: bool  # decode-only steps' layers in one C call
    c_ops: bool  # norms, q/k norm + RoPE + KV write and attention through the C custom ops
    quantized: str = ""  # the quantized weights' kinds ("4-bit, 8-bit"); "" = none
    dense_rows: int = 0  # quantized: steps of this many rows on read them as bf16 (0: never)
    int8_activations: bool = False  # quantized: every row's inputs rounded to int8 per 32 (no dense path)
    kernels: str = ""  # the measured choice of the bf16 linears' kernels (LinearPlan.describe); "" = none

    def describe(self) -> str:
        build = f"C kernels {self.build} build" if self.build else "no C kernels"
        if self.decode_stack:
            layers = "decode steps in one C call, prefill in fused C layers"
        elif self.fused_layers:
            layers = "fused C layers"
        else:
            ops = "C norms, RoPE + KV write and attention" if self.c_ops else "torch norms and attention"
            layers = f"per-op layers ({ops})"
        linears = f"{self.linears} linears" + (
            f" and quantized ({self.quantized}) ones" if self.quantized else ""
        )
        if self.quantized and self.int8_activations:
            linears += " with int8 activations"
        elif self.quantized and self.dense_rows:
            linears += f", dequantized to bf16 tiles in steps of {self.dense_rows}+ rows"
        chosen = f"; {self.kernels}" if self.kernels else ""
        return f"CPU {self.cpu} [{self.isa}]: {build}; {linears}; {layers}{chosen}"


def choose_linears(model: DecoderModel, kernels: Kernels | None) -> LinearKind:
    """Without a measured plan (kernel_choice.py measures none for several ranks, quantized weights or
    a small model): bf16 and float32 linears on the C kernel of the loaded build, whichever it is
    (VDPBF16PS on packed weights, or the weights read in place on AVX-512 without BF16 and on AVX2);
    oneDNN's packed bf16 only where no build is loaded; F.linear for anything else.

    Why the C kernel before oneDNN or MKL: they order a row's sums by the row count (their blocking
    depends on it), so a row's bits change with its neighbours, and speculative decoding would change
    plain decoding's logprobs and tokens in the default mode. The C kernels' order is fixed. Only a
    measured plan gives prefill chunks, never a decode or verify row, another kernel (and splits the
    steps that mix them). It costs nothing here: on an AVX-512 CPU without AVX512-BF16 (Skylake-SP to
    Ice Lake, emulated on a Zen 4: oneDNN held to AVX512_CORE_VNNI), SmolLM2's projections on the
    avx512 build's kernel took 0.36-0.54x oneDNN's time at 1 to 512 rows (2 threads). (float32, the
    same step on a Zen 4: the C kernel is 2.5x MKL's speed at one row, 1.7x at 32, within 7 % at a
    512-row prefill chunk, docs/PERFORMANCE.md.)"""
    if model.config.dtype in (torch.float32, torch.bfloat16) and kernels is not None:
        return "c"
    if can_prepack(model.norm.weight):  # a bf16 CPU tensor like every weight: where oneDNN has bf16
        return "onednn"
    return "torch"


def _weight_of(linear: torch.nn.Module) -> torch.Tensor | QuantizedTensor:
    return linear.qweight if isinstance(linear, QuantizedLinear) else linear.weight


def _bind_linear(
    kind: LinearKind,
    kernels: Kernels | None,
    weight: torch.Tensor | QuantizedTensor,
    bias: torch.Tensor | None,
    dtype: torch.dtype,  # the model's: a quantized weight's inputs and outputs
    dense_rows: int = 0,  # quantized: Kernels.quantized_weight's
    # by shape: Kernels.pack_weight's (bf16 on the C kernel) or quantized_weight's (int8 activations)
    tile_rows: Mapping[Shape, int] | None = None,
    int8_activations: bool = False,  # quantized: Kernels.quantized_weight's
) -> BoundLinear:
    if isinstance(weight, QuantizedTensor):
        if kernels is None:
            raise ValueError("quantized weights need the C kernels (this CPU has no build loaded)")
        tiled = (tile_rows or {}).get((weight.n, weight.k), 0) if int8_activations else 0
        return QuantLinear(
            kernels, kernels.quantized_weight(weight, dense_rows, int8_activations, tiled), bias, dtype
        )
    if kind == "c" and kernels is not None and can_bind(weight, bias):
        tiled = (
            (tile_rows or {}).get((weight.shape[0], weight.shape[1]), 0)
            if weight.dtype == torch.bfloat16
            else 0
        )
        return CLinear(kernels, weight, bias, tiled)
    if kind == "onednn" and can_prepack(weight):
        return PackedLinear(weight, bias)
    return TorchLinear(weight, bias)


def _projections(layer: DecoderLayer) -> dict[str, Linear | QuantizedLinear]:
    """The layer's four projections by their LayerKernels field."""
    a, mlp = layer.self_attn, layer.mlp
    return {"qkv": a.qkv_proj, "o": a.o_proj, "gate_up": mlp.gate_up_proj, "down": mlp.down_proj}


def bind_projections(
    layer: DecoderLayer,
    kind: LinearKind,
    kernels: Kernels | None,
    tile_rows: Mapping[Shape, int],  # _bind_linear's
    int8_activations: bool,  # _bind_linear's
    dense_rows: int = 0,  # _bind_linear's: as the fused layers read quantized weights
) -> dict[str, Projection]:
    """Each of the layer's projections bound to the kernel `kind` names (_bind_linear)."""
    dtype = layer.input_layernorm.weight.dtype
    return {
        name: _bind_linear(
            kind,
            kernels,
            _weight_of(m),
            m.bias,
            dtype,
            dense_rows,
            tile_rows=tile_rows,
            int8_activations=int8_activations,
        )
        for name, m in _projections(layer).items()
    }


def _weight(norm: RMSNorm | None) -> torch.Tensor | None:
    return None if norm is None else norm.weight


def _fuse(
    kernels: Kernels,
    layer: DecoderLayer,
    dense_rows: int,
    tile_rows: Mapping[Shape, int],
    int8_activations: bool,
    lora: LayerCLora | None,
) -> FusedLayer | None:
    """Both halves of the layer in C, when its weights are plain bf16 and its norms share one epsilon."""
    a, mlp = layer.self_attn, layer.mlp
    eps = {layer.input_layernorm.eps, layer.post_attention_layernorm.eps}
    eps |= {norm.eps for norm in (a.q_norm, a.k_norm) if norm is not None}
    if len(eps) != 1:
        return None  # the kernels take one epsilon for every norm of the layer
    weights = LayerWeights(
        input_norm=layer.input_layernorm.weight, qkv=_weight_of(a.qkv_proj), qkv_bias=a.qkv_proj.bias,
        q_norm=_weight(a.q_norm), k_norm=_weight(a.k_norm), o=_weight_of(a.o_proj), o_bias=a.o_proj.bias,
        post_norm=layer.post_attention_layernorm.weight, gate_up=_weight_of(mlp.gate_up_proj),
        gate_up_bias=mlp.gate_up_proj.bias, down=_weight_of(mlp.down_proj), down_bias=mlp.down_proj.bias,
    )  # fmt: skip
    try:
        return FusedLayer(
            kernels,
            weights,
            a.num_heads,
            a.num_kv_heads,
            eps.pop(),
            dense_rows,
            tile_rows,
            int8_activations,
            lora,
        )
    except ValueError:
        return None  # a weight (or LoRA slots) not plain bf16 of the expected shape


class CpuExecutor:
    """Runs a model's steps on the kernels bound at construction; called like the model itself."""

    def __init__(
        self,
        model: DecoderModel,
        kernels: Kernels | None,
        linears: LinearKind | None = None,  # None: choose_linears; tests force each kind
        use_stack: bool = True,  # tests turn it off to compare the stack with the per-layer calls
        cpu: CpuInfo | None = None,
        # Quantized weights: steps of this many rows on (prefill chunks; 0: none) read each weight as
        # its bf16 rounding, at the bf16 kernel's speed, where the exact per-block sums cost 1.3x. It
        # must exceed every step without prompt rows (EngineConfig.max_rows_without_prompt), so that a
        # decode or verify row's sums keep one order and speculation stays exact.
        dense_rows: int = 0,
        # The measured kernels of the bf16 linears (kernel_choice.py), for this build: None, the flags'.
        plan: LinearPlan | None = None,
        # With int8 activations on the amx build: which quantized shapes tile from which row count.
        int8_plan: Int8TilePlan | None = None,
        # Quantized weights: every row's inputs rounded to int8 per block of 32, prefill chunks too
        # (--quantized-activations int8, csrc/linear_int8.c); lossy, and still one order per row.
        int8_activations: bool = False,
        # LoRA slots (models/lora.py): each step's adapted rows get their deltas on whichever path
        # the step takes (see the NOTE).
        lora: LoraTable | None = None,
    ) -> None:
        self.model = model
        self.lora = lora
        config = model.config
        kind = linears or (
            "c" if plan is not None and kernels is not None else choose_linears(model, kernels)
        )
        tiles = {} if plan is None else {shape: plan.tile_rows(shape) for shape, _ in plan.exact}
        if int8_plan is not None:  # quantized shapes, none a bf16 linear's (int8_tile_choice.py)
            tiles |= int8_plan.as_map()
        c_ops = (
            kernels is not None
            and config.dtype in DTYPE_CODES
            and bool(fits(kernels.limits, head_dim=config.head_dim, row=config.hidden_size, rotary=True))
        )
        ops = register(kernels) if kernels is not None and c_ops else None
        if kernels is not None and ops is not None:
            tiled = (
                kernels.tiled_attention
                and config.dtype == torch.bfloat16
                and bool(fits(kernels.limits, head_dim=config.head_dim, tiled=True))
            )
            model.use_attention(CpuPagedAttention(ops, kernels.limits, tiled))
        self.fused: list[FusedLayer] | None = None
        # A float16 model's slots stay on torch's deltas, as its linears do: the C kernel takes float32
        # and bf16 rows only (DTYPE_CODES), and a float16 decoder with LoRA on died binding them.
        bound = (
            bind_table(kernels, lora)
            if kernels is not None and lora is not None and config.dtype in DTYPE_CODES
            else None
        )
        self.c_lora = bound  # each layer's LoRA slots on the C kernel; None: none or the torch reference's
        # The fused halves run the same norms, RoPE and cache write as the C ops: within their limits.
        # bf16 only: a float32 model's layers run op by op, each linear on the C float32 kernel.
        if (
            kernels is not None
            and c_ops
            and kind == "c"
            and model.tp is None
            and config.dtype == torch.bfloat16
        ):
            fused = [
                _fuse(
                    kernels, layer, dense_rows, tiles, int8_activations, None if bound is None else bound[i]
                )
                for i, layer in enumerate(model.layers)
            ]
            if all(f is not None for f in fused):
                self.fused = [f for f in fused if f is not None]
        self.stack = self._bind_stack(kernels) if use_stack else None
        if self.fused is not None:
            layers = tuple(
                LayerKernels(fused=f, lora=None if bound is None else partial(c_deltas, bound[i]))
                for i, f in enumerate(self.fused)
            )
        else:
            layers = tuple(
                per_op(
                    layer,
                    ops,
                    # several ranks, or a layer the fused halves cannot take: the same kernels
                    bind_projections(layer, kind, kernels, tiles, int8_activations, dense_rows),
                    None if bound is None else bound[i],
                )
                for i, layer in enumerate(model.layers)
            )
        # Prefill chunks on kernels of their own: a step mixing them with decode rows runs in parts
        # (prefill_split.py); the chunks' layers op by op where oneDNN runs some of their linears.
        self.split_rows = (
            plan.prefill_rows if plan is not None and plan.splits_prefill and model.tp is None else 0
        )
        self.prefill_layers = (
            self._prefill_layers(plan, kernels, ops, layers) if self.split_rows and plan is not None else ()
        )
        walk = CpuWalk(self.stack, self.split_rows, self.prefill_layers)
        head = _bind_linear(
            kind, kernels, model.head_weight, None, config.dtype, dense_rows, tiles, int8_activations
        )
        # A decode or verify row's bits are the same at any row count only when no linear is torch's
        # (F.linear and oneDNN block a row's sums by the row count: MKL's float32 GEMM gives a row
        # other bits among 5 rows than alone). Without it (no build loaded, or a test forcing
        # oneDNN or torch) --batch-invariant verifies row by row.
        per_op_linears = [getattr(lk, name) for lk in layers for name in ("qkv", "o", "gate_up", "down")]
        exact_layers = self.fused is not None or all(
            p is not None and not isinstance(p, TorchLinear) for p in per_op_linears
        )
        self.rows_exact = exact_layers and not isinstance(head, TorchLinear)
        has_walk = self.stack is not None or self.split_rows > 0
        self.kernels = ModelKernels(layers, head, walk if has_walk else None)
        # torch's argmax took 0.9 ms of a 24.5 ms step at 32 sequences; the C one takes 0.12.
        self._argmax = kernels.argmax if kernels is not None else None
        # A quantized token table's rows: ~20 torch ops took 79-88 us for one token (~1.4 % of a
        # one-sequence int8 step, Zen 4); the C lookup gives the same bits in 7.
        table = model.embed_tokens
        if kernels is not None and isinstance(table, QuantizedEmbedding) and table.dtype in DTYPE_CODES:
            table.use_rows(
                partial(kernels.quantized_rows, kernels.quantized_weight(table.qweight), dtype=table.dtype)
            )
        cpu = cpu or this_cpu()
        self.choice = KernelChoice(
            cpu=cpu.model_name,
            isa=cpu.isa_summary,
            build=None if kernels is None else kernels.level.name,
            linears=kind,
            fused_layers=self.fused is not None,
            decode_stack=self.stack is not None,
            c_ops=ops is not None,
            quantized=", ".join(
                sorted({f"{m.qweight.bits}-bit" for m in model.modules() if isinstance(m, QUANTIZED_MODULES)})
            ),
            # Only the packed bf16 kernel's builds have the dense path; elsewhere every row is exact.
            dense_rows=dense_rows
            if kernels is not None and kernels.weight_layout != 0 and config.dtype == torch.bfloat16
            else 0,
            kernels="; ".join(p.describe() for p in (plan, int8_plan) if p is not None),
            int8_activations=int8_activations,
        )

    def _prefill_layers(
        self,
        plan: LinearPlan,
        kernels: Kernels | None,
        ops: Any | None,
        layers: tuple[LayerKernels, ...],  # the step's own
    ) -> tuple[LayerKernels, ...]:
        """Each layer op by op for prompt chunks, where oneDNN runs the shapes the plan gives it and
        every other linear is the exact path's own bound weight (no second copy); () when no shape is
        oneDNN's (the chunks then take the exact path, whose weights tile from prefill_rows rows). Their
        LoRA deltas are the torch reference's."""
        onednn = plan.onednn_shapes
        if not onednn:
            return ()
        prefill = []
        for i, layer in enumerate(self.model.layers):
            linears: dict[str, Projection] = {}
            for name, module in _projections(layer).items():
                weight, bias = _weight_of(module), module.bias
                exact = getattr(layers[i], name)
                if (weight.shape[0], weight.shape[1]) in onednn and isinstance(weight, torch.Tensor):
                    linears[name] = PackedLinear(weight, bias)
                elif self.fused is not None and kernels is not None:
                    linears[name] = KernelLinear(kernels, self.fused[i].kernel_weights[name], bias)
                else:
                    linears[name] = exact
            prefill.append(per_op(layer, ops, linears))
        return tuple(prefill)

    def _bind_stack(self, kernels: Kernels | None) -> DecodeStack | None:
        """Every fused layer in one C call, when they share their sizes and the C decode attention takes
        the model's heads (DecodeStack asks)."""
        scales = {layer.self_attn.scale for layer in self.model.layers}
        if kernels is None or not self.fused or len(scales) != 1:
            return None
        try:
            return DecodeStack(kernels, self.fused, scales.pop())
        except ValueError:
            return None  # layers of different sizes, or heads past the C attention's limits

    def __call__(
        self,
        batch: ForwardBatch,  # its lora, if any, on the table this executor was bound to
        kv_caches: list[torch.Tensor],  # per layer [2, num_blocks, block_size, num_kv_heads, head_dim]
    ) -> torch.Tensor:
        """float32 logits [num_logits, vocab_size] at attn.logits_indices: the model's forward."""
        return self.compute_logits(self.hidden_states(batch, kv_caches))

    def hidden_states(self, batch: ForwardBatch, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """The final hidden rows [num_logits, hidden_size]: the model's, on the bound kernels."""
        if batch.lora is not None and batch.lora.table is not self.lora:
            raise ValueError("a step's LoRA table must be the one the executor was bound to")
        return self.model.hidden_states(batch, kv_caches, self.kernels)

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        """float32 logits [num_rows, vocab_size] of final hidden rows [num_rows, hidden_size]."""
        return self.model.compute_logits(h, self.kernels)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """int64 [num_rows]: torch.argmax(logits, dim=-1), in C when the kernels are loaded."""
        if self._argmax is None or logits.dtype != torch.float32 or not logits.is_contiguous():
            return self.model.argmax(logits)
        return self._argmax(logits)


def bind(
    model: DecoderModel, options: KernelOptions | None = None, lora: LoraTable | None = None
) -> CpuExecutor:
    """The executor for a loaded model, its choice logged in one line: kernels chosen as `options`
    say (kernel_choice.py: measured, cached or named), or from the CPU's flags alone without them;
    `lora` the LoRA slots it binds (None: off)."""
    if options is None:
        executor = CpuExecutor(model, load_for_cpu(), lora=lora)
    else:
        kernels, plan = kernel_choice.choose(model, options)
        executor = CpuExecutor(
            model,
            kernels,
            dense_rows=options.prefill_rows,
            plan=plan,
            int8_plan=int8_tile_choice.int8_tiles(model, kernels, options),
            int8_activations=options.int8_activations,
            lora=lora,
        )
    log.info("%s", executor.choice.describe())
    return executor
