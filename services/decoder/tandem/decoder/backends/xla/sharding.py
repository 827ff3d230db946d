"""Several XLA devices as one SPMD program: where the plain model's tensors are sharded.

NOTE: the layout (Megatron TP + SP, the layout NxD Inference compiles for context encoding). The
model is the one plain model (`tp` None): no collective is written anywhere. Sharding annotations
on its weights, its inputs and a few activations tell XLA's SPMD partitioner how to split the one
program over the mesh's devices, and the partitioner inserts the collectives:

- weights: the column-parallel projections (`qkv_proj`, `gate_up_proj`) split their output rows,
  the row-parallel ones (`o_proj`, `down_proj`) their input columns, the token table (and a separate
  LM head) its vocabulary rows; norms are replicated. The KV cache splits its KV heads when they
  divide evenly (else each device holds it whole).
- quantized weights (`--quantization`): split as the dense ones, in the units their codes, scales and
  offsets are stored in (common/torch_part/quantized_tensor.py): output rows in whole groups of 16,
  inputs in whole blocks of 32. Each is held viewed [groups, blocks, bytes], so either cut is one
  tensor dimension; a device's part is then what models/quantized_shards.py's `cut` gives a rank, and
  the weight's values, dequantized inside the graph, are the one-device model's. A weight whose groups
  or blocks do not divide evenly over the devices is held whole on each.
- prefill (any step with a prompt chunk): the residual stream lives in sequence slices. The step's
  per-position inputs (`input_ids`, `positions`, `is_token_ids`, `inputs_embeds`) arrive split along
  the sequence, so the token embedding, the prompt-embedding merge (`torch.where` on `is_token_ids`)
  and every norm run on each device's own window. Each column-parallel projection's input is
  annotated whole (an all-gather along the sequence) and its output split by features; each
  row-parallel projection's output is annotated split by sequence (a reduce-scatter of the partial
  sums).
- decode: tensor-parallel only. The residual stream is replicated; a row-parallel output annotated
  replicated is an all-reduce.

Annotations never change what is computed, only where: a sharded run gives the unsharded result
up to the order of summation across devices (the tests compare against the CPU engine).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch
from torch import nn

from tandem.common.torch_part.quantized_tensor import BLOCK, GROUP, QuantizedTensor
from tandem.decoder.backends.xla.attention import XlaPagedAttention
from tandem.decoder.backends.xla.host_pool import splits_heads
from tandem.decoder.models.forward_batch import ForwardBatch
from tandem.decoder.models.quantized import QuantizedEmbedding, QuantizedLinear
from tandem.decoder.models.transformer import Attention, DecoderLayer, DecoderModel

AXIS = "x"  # the mesh's one axis: every device holds one slice of the sequence and of the features
Spec = tuple[str | None, ...]
REPLICATED_ROWS: Spec = (None, None)
SEQUENCE_ROWS: Spec = (AXIS, None)  # [num_tokens, hidden]: each device a window of positions
FEATURE_COLUMNS: Spec = (None, AXIS)  # [num_tokens, features]: each device a slice of the features


class ShardingPlan:
    """Shards a loaded model over `num_devices` XLA devices (one mesh axis) and annotates each step.

    With one device there is nothing to shard: every method is a no-op and no hook is installed.
    """

    def __init__(self, num_devices: int) -> None:
        self.num_devices = num_devices
        self.mesh = None
        self.is_prefill = False  # the annotations of the step being traced (set by `step`)
        self.splits_heads = False  # attention head-parallel: query and KV heads divide evenly (shard_model)
        if num_devices > 1:
            from torch_xla.distributed import spmd as xs

            self._xs = xs
            self.mesh = xs.Mesh(np.arange(num_devices), (num_devices,), (AXIS,))

    def shard_model(self, model: DecoderModel, kv_caches: list[torch.Tensor]) -> None:
        """Marks every weight and KV cache with its split and hooks the activation annotations in."""
        if self.mesh is None:
            return
        head = model.embed_tokens if model.lm_head is None else model.lm_head
        for table in {model.embed_tokens, head}:
            self._shard_weight(table, 0, is_table=True)
        for layer in model.layers:
            assert isinstance(layer, DecoderLayer)
            attention: Attention = layer.self_attn
            for column in (attention.qkv_proj, layer.mlp.gate_up_proj):
                self._shard_weight(column, 0)
                if column.bias is not None:
                    self._mark(column.bias, (AXIS,))  # a row-parallel bias is added once, whole
                column.register_forward_pre_hook(self._whole_input)
                column.register_forward_hook(self._feature_output)
            for row in (attention.o_proj, layer.mlp.down_proj):
                self._shard_weight(row, 1)
                row.register_forward_hook(self._summed_output)
            layer.register_forward_pre_hook(self._residual_input)
        self.splits_heads = splits_heads(model.config, self.num_devices)
        kv_spec: Spec = (None, None, None, AXIS if self.splits_heads else None, None)
        for cache in kv_caches:
            self._mark(cache, kv_spec)
        model.use_attention(XlaPagedAttention(self))

    def step(self, inputs: ForwardBatch, is_prefill: bool) -> None:
        """Annotates this step's inputs; the hooks then annotate its activations for `is_prefill`."""
        self.is_prefill = is_prefill
        if self.mesh is None or not is_prefill:
            return  # decode: inputs replicated, which is what a plain transfer gives
        for tensor in (inputs.input_ids, inputs.positions, inputs.is_token_ids):
            if tensor is not None:
                self._mark(tensor, (AXIS,))
        if inputs.inputs_embeds is not None:
            self._mark(inputs.inputs_embeds, SEQUENCE_ROWS)

    def head_split(self, tensor: torch.Tensor, dim: int) -> None:
        """Annotates `tensor` split over its heads along `dim`, where the model's heads divide evenly
        (attention then runs head-parallel on each device's own KV heads, as Megatron TP does)."""
        if self.mesh is not None and self.splits_heads:
            self._mark(tensor, tuple(AXIS if d == dim else None for d in range(tensor.dim())))

    def vocab_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The LM head's logits [rows, vocab], computed on each device's vocabulary rows, then gathered
        whole (without the first annotation XLA may gather the whole table to every device instead)."""
        if self.mesh is None:
            return logits
        if logits.shape[1] % self.num_devices == 0:
            self._mark(logits, FEATURE_COLUMNS)
            logits = logits.clone()
        return self.whole(logits)

    def whole(self, tensor: torch.Tensor) -> torch.Tensor:
        """Annotates a step's output replicated, so it is gathered inside the graph: reading a tensor
        that is still split back to the host makes torch_xla compile a gathering graph at every read."""
        if self.mesh is not None:
            self._mark(tensor, (None,) * tensor.dim())
        return tensor

    def _shard_weight(self, module: nn.Module, dim: int, is_table: bool = False) -> None:
        """Splits `module`'s weight [n, k] along `dim` (0: output rows, 1: inputs). A table (token
        embedding, LM head) or a quantized weight that does not divide evenly is held whole on every
        device; a dense projection is split all the same (XLA pads the last device's part)."""
        if isinstance(module, QuantizedLinear | QuantizedEmbedding):
            module.qweight = self._shard_quantized(module.qweight, dim)
            return
        weight = module.weight
        split = not is_table or weight.shape[dim] % self.num_devices == 0
        self._mark(weight, tuple(AXIS if split and d == dim else None for d in range(2)))

    def _shard_quantized(self, weight: QuantizedTensor, dim: int) -> QuantizedTensor:
        """`weight` with its codes, scales and offsets viewed [groups, blocks, bytes] and split along
        its groups of 16 output rows (dim 0) or its blocks of 32 inputs (dim 1), where they divide
        evenly. The view is made on the host: a view of device data is an op in every graph, its
        base held whole on each device."""
        units = (-(-weight.n // GROUP), weight.k // BLOCK)  # [groups, blocks]
        split = units[dim] % self.num_devices == 0
        spec: Spec = tuple(AXIS if split and d == dim else None for d in range(3))

        def placed(tensor: torch.Tensor) -> torch.Tensor:
            held = tensor.cpu().view(*units, -1).to(tensor.device)
            self._mark(held, spec)
            return held

        return dataclasses.replace(
            weight,
            codes=placed(weight.codes),
            scales=placed(weight.scales),
            mins=None if weight.mins is None else placed(weight.mins),
        )

    def _mark(self, tensor: torch.Tensor, spec: Spec) -> None:
        self._xs.mark_sharding(tensor, self.mesh, spec)

    # -- activation annotations, as module hooks: the model's code stays plain -------------------

    def _residual_input(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if self.is_prefill:
            self._mark(args[0], SEQUENCE_ROWS)  # h: the residual stream, a window per device

    def _whole_input(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        self._mark(args[0], REPLICATED_ROWS)  # prefill: the all-gather along the sequence

    def _feature_output(self, module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> None:
        self._mark(output, FEATURE_COLUMNS)

    def _summed_output(self, module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> None:
        # prefill: reduce-scatter into sequence windows; decode: all-reduce to every device
        self._mark(output, SEQUENCE_ROWS if self.is_prefill else REPLICATED_ROWS)
