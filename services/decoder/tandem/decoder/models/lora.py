"""LoRA slots: every loaded adapter's weights side by side, and the per-row delta a step adds.

NOTE: the rule (Punica / S-LoRA). A step's rows may each use a different adapter or none; the batch
is never split per adapter. Each row carries a slot (`LoraStep.slots`, -1 = the base model), and
every adapted projection adds, to row t with slot s >= 0,

    y[t, part p's columns] += scale[s] * (x[t] @ A[s, p]^T) @ B[s, p]^T

where the parts are the checkpoint modules a fused projection holds (q/k/v in qkv_proj, gate/up in
gate_up_proj; one part elsewhere). A row's delta reads its own slot only, so no row can read another
adapter's weights, and a row with slot -1 is the base model's bit for bit.

NOTE: the layout. Per layer and projection, a slot holds its parts' A rows one part after the other,
`a [max_loras, num_parts * max_rank, in_features]`, and B transposed, `bt [max_loras, max_rank,
out_features]` (part p's columns of bt are its B^T). `ranks [max_loras, num_parts]` says how many
rows of each part are the adapter's (0: the adapter leaves that part alone); the rest are zeros. The
weights are in the model dtype; the sums are float32, rounded once into y.

`add_delta` is the reference (plain torch: each row's slot gathered, products summed per row); the
CPU executor runs the same sums in a C kernel (backends/cpu/lora.py), reading the slots in place.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from tandem.decoder.models.config import ModelConfig
from tandem.decoder.models.peft_adapter import LoraAdapter
from tandem.decoder.models.peft_weights import module_shapes
from tandem.decoder.models.tensor_parallel import ParallelGroup, world_size_of

# Each projection of the model and the checkpoint modules it fuses, in output order.
PARTS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
ROW_PARALLEL = ("o_proj", "down_proj")  # input features sharded over the ranks; the rest: outputs
_ROWS_PER_CHUNK = 64  # add_delta gathers weights for this many rows at a time


class ProjectionLora:
    """One layer's projection: its slots' stacked weights (see the NOTE on the layout)."""

    def __init__(
        self,
        config: ModelConfig,
        name: str,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        tp: ParallelGroup | None = None,  # this rank's shard (see the NOTE); None: the whole projection
    ) -> None:
        shapes = module_shapes(config)
        world_size = world_size_of(tp)
        self.parts = PARTS[name]
        self.rank = 0 if tp is None else tp.rank
        self.row_parallel = name in ROW_PARALLEL
        self.in_features = shapes[self.parts[0]][1] // (world_size if self.row_parallel else 1)
        ends, end = [], 0
        for part in self.parts:
            end += shapes[part][0] // (1 if self.row_parallel else world_size)
            ends.append(end)
        self.part_ends = tuple(ends)  # each part's last output column + 1
        self.out_features = end
        self.max_rank = max_rank
        self.a = torch.zeros(max_loras, len(self.parts) * max_rank, self.in_features, dtype=dtype)
        self.bt = torch.zeros(max_loras, max_rank, self.out_features, dtype=dtype)
        self.ranks = torch.zeros(max_loras, len(self.parts), dtype=torch.int64)

    def write(self, slot: int, layer: int, adapter: LoraAdapter) -> None:
        """The adapter's weights for this layer's projection into `slot` (zeros where it has none)."""
        self.a[slot].zero_()
        self.bt[slot].zero_()
        self.ranks[slot].zero_()
        start = 0
        for p, part in enumerate(self.parts):
            pair = adapter.weights.get((layer, part))
            end = self.part_ends[p]
            if pair is not None:
                a, b = pair  # the whole checkpoint module's: [rank, in_features], [out_features, rank]
                if self.row_parallel:  # this rank's input columns of A
                    a = a[:, self.rank * self.in_features : (self.rank + 1) * self.in_features]
                else:  # this rank's output rows of the part's B
                    b = b[self.rank * (end - start) : (self.rank + 1) * (end - start)]
                rows = p * self.max_rank
                self.a[slot, rows : rows + adapter.rank] = a
                self.bt[slot, : adapter.rank, start:end] = b.t()
                self.ranks[slot, p] = adapter.rank
            start = end

    def add_delta(
        self,
        x: torch.Tensor,  # [num_tokens, in_features]
        y: torch.Tensor,  # [num_tokens, out_features], the base projection's output; updated in place
        slots: torch.Tensor,  # int64 [num_tokens], -1 = base
        scales: torch.Tensor,  # float32 [max_loras]
    ) -> torch.Tensor:
        """y plus each adapted row's delta, in plain torch (the reference); returns y. A row's bits do
        not depend on the other rows."""
        rows = (slots >= 0).nonzero().flatten()  # [n]
        for start in range(0, rows.shape[0], _ROWS_PER_CHUNK):
            chunk = rows[start : start + _ROWS_PER_CHUNK]  # [c]
            s = slots.index_select(0, chunk)  # [c]
            xs = x.index_select(0, chunk).float()  # [c, in_features]
            # Products summed by torch's reductions, not a matmul: a matmul's sums may block by the
            # number of rows, a reduction's follow the summed dimension alone.
            a = self.a.index_select(0, s).float()  # [c, parts * max_rank, in_features]
            u = (a * xs[:, None, :]).sum(-1)  # [c, parts * max_rank]
            out = y.index_select(0, chunk).float()  # [c, out_features]
            bt = self.bt.index_select(0, s).float()  # [c, max_rank, out_features]
            lo = 0
            for p, hi in enumerate(self.part_ends):
                up = u[:, p * self.max_rank : (p + 1) * self.max_rank, None]  # [c, max_rank, 1]
                delta = (up * bt[:, :, lo:hi]).sum(1)  # [c, hi - lo]
                out[:, lo:hi] += delta * scales.index_select(0, s)[:, None]
                lo = hi
            y.index_copy_(0, chunk, out.to(y.dtype))
        return y


class LoraTable:
    """`max_loras` slots of rank up to `max_rank` for every projection of every layer."""

    def __init__(
        self,
        config: ModelConfig,
        max_loras: int,
        max_rank: int,
        device: torch.device,
        tp: ParallelGroup | None = None,  # the rank whose shard the slots hold; None: one rank
    ) -> None:
        if device.type != "cpu":
            raise ValueError(f"LoRA slots live on the CPU, not {device}")
        self.config = config  # the whole model's, as an adapter's checkpoint modules are
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.scales = torch.zeros(max_loras, dtype=torch.float32)  # [max_loras]
        self.layers = [
            {name: ProjectionLora(config, name, max_loras, max_rank, config.dtype, tp) for name in PARTS}
            for _ in range(config.num_layers)
        ]

    @property
    def num_bytes(self) -> int:
        return sum(p.a.nbytes + p.bt.nbytes for layer in self.layers for p in layer.values())

    def write(self, slot: int, adapter: LoraAdapter) -> None:
        """Put `adapter` in `slot` (whose previous adapter no live request uses any more)."""
        if not 0 <= slot < self.max_loras:
            raise ValueError(f"slot must be in [0, {self.max_loras}), got {slot}")
        if adapter.rank > self.max_rank:
            raise ValueError(f"an adapter of rank {adapter.rank} in slots of rank {self.max_rank}")
        for layer, projections in enumerate(self.layers):
            for projection in projections.values():
                projection.write(slot, layer, adapter)
        self.scales[slot] = adapter.scale


class SlotProjection(Protocol):
    """A projection's slots as a step adds their delta: ProjectionLora, or a device's copy of it."""

    def add_delta(
        self, x: torch.Tensor, y: torch.Tensor, slots: torch.Tensor, scales: torch.Tensor
    ) -> torch.Tensor: ...


class SlotTable(Protocol):
    """What a step reads of a table of slots: LoraTable, or a device's copy (backends/xla/lora.py)."""

    @property
    def layers(self) -> Sequence[Mapping[str, SlotProjection]]: ...  # per layer, by PARTS' names

    @property
    def scales(self) -> torch.Tensor: ...  # float32 [max_loras]


@dataclass(frozen=True)
class LoraStep:
    """The adapters of one step: the table, and each row's slot."""

    table: SlotTable
    slots: torch.Tensor | None  # int64 [num_tokens], -1 = base; None: no row of the step uses one

    def layer(self, index: int) -> LayerLora | None:
        """The deltas of layer `index`'s projections, or None when no row of the step is adapted."""
        if self.slots is None:
            return None
        projections, slots, scales = self.table.layers[index], self.slots, self.table.scales
        return LayerLora(
            *(LoraDelta(projections[name], slots, scales) for name in PARTS),  # PARTS' order: the fields'
            slots,
        )


@dataclass(frozen=True)
class LoraDelta:
    """One projection's delta for one step, called as `delta(x, y) -> y` after the base projection."""

    projection: SlotProjection
    slots: torch.Tensor  # int64 [num_tokens]
    scales: torch.Tensor  # float32 [max_loras]

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.projection.add_delta(x, y, self.slots, self.scales)


# A projection's delta for one step: (x [num_tokens, in], y [num_tokens, out]) -> y, y updated in place.
Delta = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class LayerLora:
    """One layer's deltas for one step (fields in PARTS' order): LoraDelta, or the CPU kernel's."""

    qkv_proj: Delta
    o_proj: Delta
    gate_up_proj: Delta
    down_proj: Delta
    # int64 [num_tokens] each row's slot (-1: base), for a kernel that adds all four deltas itself (a
    # fused layer, models/kernels.py) instead of calling them.
    slots: torch.Tensor
