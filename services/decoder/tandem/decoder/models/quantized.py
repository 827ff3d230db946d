"""The modules that replace a model's linears and token table when its weights are quantized, and
`apply`, which swaps them in. The weights' form is common/torch_part/quantized_tensor.py's.

`QuantizedLinear`'s forward (the reference the CPU kernels are tested against) and
`QuantizedEmbedding`'s lookup rebuild the values they need per call, in fp32, rounded to the model's
dtype; the CPU executor's kernels read the same tensors in place.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tandem.common.torch_part.quantized_tensor import QuantizedTensor, quantize_scheme, quantize_table
from tandem.decoder.models.config import ModelConfig
from tandem.decoder.models.quantized_shards import cut
from tandem.decoder.models.tensor_parallel import CheckpointPart, ParallelGroup, vocab_parallel_rows


class QuantizedLinear(nn.Module):
    """The model's linear over a quantized weight; its forward dequantizes per call (the reference:
    the CPU executor binds a kernel that reads the codes in place)."""

    def __init__(self, weight: QuantizedTensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.qweight = weight
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.in_features, self.out_features = weight.k, weight.n

    def forward(self, x: torch.Tensor, with_bias: bool = True) -> torch.Tensor:
        # x: [num_tokens, in_features] -> [num_tokens, out_features]
        return F.linear(x, self.qweight.dequantize(x.dtype), self.bias if with_bias else None)


class QuantizedEmbedding(nn.Module):
    """A token-embedding table kept quantized: a lookup dequantizes only the rows it returns (the
    same values the tied LM head multiplies). An executor may bind a kernel that computes the same
    rows (`use_rows`: the CPU one's reads the codes in place, where `QuantizedTensor.rows`, the
    reference, takes ~20 torch ops)."""

    def __init__(self, weight: QuantizedTensor, dtype: torch.dtype, tp: ParallelGroup | None = None) -> None:
        super().__init__()
        self.qweight = weight  # [vocab_size / world_size, hidden_size]: this rank's rows
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = weight.n, weight.k
        self.tp = tp  # None: one rank, the whole table here
        self.vocab_start = 0 if tp is None else tp.rank * weight.n  # first vocabulary id held here
        self._rows: Callable[[torch.Tensor], torch.Tensor] | None = None

    def use_rows(self, rows: Callable[[torch.Tensor], torch.Tensor] | None) -> None:
        """Looks rows up with `rows` (int64 ids [num] -> [num, embedding_dim] in self.dtype, the values
        QuantizedTensor.rows gives); None: the reference again."""
        self._rows = rows

    def forward(self, ids: torch.Tensor, sp: bool = False) -> torch.Tensor:
        # ids: [num_tokens] -> [num_tokens, embedding_dim]; with several ranks summed over them, as
        # VocabParallelEmbedding: [local_len under SP, else num_tokens, embedding_dim].
        if self.tp is not None:
            return vocab_parallel_rows(self._lookup, ids, self.vocab_start, self.num_embeddings, self.tp, sp)
        return self._lookup(ids.reshape(-1)).view(*ids.shape, self.embedding_dim)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        # ids: int [num] in [0, num_embeddings) -> [num, embedding_dim] in self.dtype
        flat = ids.long()
        return self.qweight.rows(flat, self.dtype) if self._rows is None else self._rows(flat)


QUANTIZED_MODULES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head", "embed_tokens")


def quantizable(model: nn.Module) -> list[str]:
    """The parameter names of what quantizes: every linear (qkv, o, gate_up, down, an untied LM head)
    and the token table (which a tied LM head multiplies)."""
    return [
        f"{name}.weight"
        for name, module in model.named_modules()
        if name.rpartition(".")[2] in QUANTIZED_MODULES and hasattr(module, "weight")
    ]


def input_widths(config: ModelConfig) -> dict[str, int]:
    """The input width of the quantized linears of a model of `config` (their rows' length; the token
    table's is hidden_size too)."""
    return {
        "qkv_proj and gate_up_proj (hidden_size)": config.hidden_size,
        "o_proj (num_heads * head_dim)": config.num_heads * config.head_dim,
        "down_proj (intermediate_size)": config.intermediate_size,
    }


def check_group(config: ModelConfig, group_size: int) -> None:
    """Raises ValueError unless every quantized weight's rows are whole groups of `group_size`."""
    for what, width in input_widths(config).items():
        if width % group_size != 0:
            raise ValueError(f"{width}, the input width of {what}, is not a multiple of {group_size}")


def rounded(
    model: nn.Module,
    scheme: str,
    group_size: int,
    read_whole: Callable[[CheckpointPart], torch.Tensor] | None = None,
) -> dict[str, QuantizedTensor]:
    """--quantization int8 / int4: each of the model's quantizable weights rounded from its dense
    values (in the model's dtype), for `apply`: the linears as `scheme` says, the token table and the
    LM head 8-bit per row under either.

    With several ranks each weight is this rank's cut of the one-rank model's (quantized_shards.py):
    a weight cut by rows is its rank's rows rounded (each row rounds alone), one cut by inputs is
    rounded whole, as `read_whole` reads its checkpoint tensor (in the model's dtype), then cut."""
    tp = getattr(model, "tp", None)
    out = {}
    for name in quantizable(model):
        is_table = name.removesuffix(".weight").rpartition(".")[2] in ("embed_tokens", "lm_head")
        parts = [] if tp is None else model.checkpoint_parts(name)
        by_inputs = next((part for part in parts if part.shard_dim == 1), None)
        if by_inputs is None:
            out[name] = _round(model.get_parameter(name), is_table, scheme, group_size)
        elif read_whole is None:
            raise ValueError(f"{name} is cut by its inputs: it is rounded whole, and needs read_whole")
        else:
            whole = _round(read_whole(by_inputs), is_table, scheme, group_size)
            out[name] = cut(whole, 1, tp.rank, tp.world_size)
    return out


def _round(weight: torch.Tensor, is_table: bool, scheme: str, group_size: int) -> QuantizedTensor:
    return quantize_table(weight) if is_table else quantize_scheme(weight, scheme, group_size)


def apply(model: nn.Module, weights: dict[str, QuantizedTensor]) -> None:
    """Replaces the model's linears and token embedding named in `weights` (parameter names, e.g.
    "layers.0.self_attn.qkv_proj.weight", "embed_tokens.weight", "lm_head.weight") by their quantized
    forms; the dense weights they held are released."""
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    for name, weight in weights.items():
        module_name = name.removesuffix(".weight")
        parent_name, _, attr = module_name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, attr)
        if tuple(old.weight.shape) != weight.shape:
            raise ValueError(
                f"{name}: a quantized weight of {list(weight.shape)} for {list(old.weight.shape)}"
            )
        if attr == "embed_tokens":
            setattr(parent, attr, QuantizedEmbedding(weight, dtype, getattr(old, "tp", None)))
        else:
            setattr(parent, attr, QuantizedLinear(weight, getattr(old, "bias", None)))


def move(model: nn.Module, device: torch.device) -> None:
    """Every quantized weight's tensors onto `device` (model.to moves parameters and buffers only): an
    XLA device then dequantizes each weight inside the step's graph, its reference forward."""
    for module in model.modules():
        if isinstance(module, QuantizedLinear | QuantizedEmbedding):
            w = module.qweight
            module.qweight = dataclasses.replace(
                w,
                codes=w.codes.to(device),
                scales=w.scales.to(device),
                mins=None if w.mins is None else w.mins.to(device),
            )
