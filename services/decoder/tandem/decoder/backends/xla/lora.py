"""LoRA slots on the XLA device: a copy of the host table (models/lora.py), and a delta of one shape.

NOTE: why not the host's delta. `ProjectionLora.add_delta` gathers the adapted rows (`nonzero`), a
shape that depends on the batch's values: traced, every mix of adapted rows would be a new graph. Here
every row takes the same path, whatever its slot: the step's rows against every slot's A at once,
u = x A_all^T [num_tokens, slots * parts * max_rank], each column kept only where its slot is the
row's (times the slot's scale, zero elsewhere), then one product with every slot's B stacked,
[slots * parts * max_rank, out_features], each part's rows holding only that part's columns. A row
of the base model (slot -1) keeps no column: its delta is zeros and y + 0 is y, bit for bit. The
graph depends on the table's sizes alone, so loading, unloading and any mix of adapters compile
nothing after warmup; the price is that every row pays for every slot's A (slots x parts x max_rank
products per input feature: for 4 slots of rank 16, 192 columns beside a projection's hundreds).

The sums run in float32 over the slots' values in the model dtype (the host table's), like the
host's; the scale multiplies u rather than the product, so the bits are not the CPU's.

Loading an adapter writes the host table, then `refresh` uploads the slots again: new device buffers
of the same shapes, which the cached graphs take as they are.
"""

from __future__ import annotations

import torch

from tandem.decoder.backends.xla import runtime
from tandem.decoder.models.lora import LoraTable, ProjectionLora


class XlaProjectionLora:
    """One layer's projection: every slot's A and B on the device, laid out for the delta above."""

    def __init__(self, host: ProjectionLora, device: torch.device) -> None:
        self.host = host
        self.device = device
        num_slots = host.a.shape[0]
        width = len(host.parts) * host.max_rank
        # Column j of u belongs to slot j // width.
        self.column_slots = torch.arange(num_slots).repeat_interleave(width).to(device)  # [S * P * R]
        self.refresh()

    def refresh(self) -> None:
        """Upload the host's slots (after an adapter was written into one)."""
        host = self.host
        num_slots, max_rank = host.a.shape[0], host.max_rank
        a = host.a.float().reshape(-1, host.in_features)  # [S * P * R, in_features]
        b = torch.zeros(num_slots, len(host.parts), max_rank, host.out_features)  # float32
        lo = 0
        for p, hi in enumerate(host.part_ends):
            b[:, p, :, lo:hi] = host.bt[:, :, lo:hi].float()  # part p's rows: its columns of B^T only
            lo = hi
        self.a = a.to(self.device)
        self.b = b.reshape(-1, host.out_features).to(self.device)  # [S * P * R, out_features]

    def add_delta(
        self,
        x: torch.Tensor,  # [num_tokens, in_features]
        y: torch.Tensor,  # [num_tokens, out_features], the base projection's output
        slots: torch.Tensor,  # int64 [num_tokens], -1 = base
        scales: torch.Tensor,  # float32 [max_loras]
    ) -> torch.Tensor:
        """y plus each row's delta (zeros for a base row); the same graph for any slots."""
        u = x.float() @ self.a.t()  # [num_tokens, S * P * R]
        keep = (slots[:, None] == self.column_slots[None, :]).float()  # [num_tokens, S * P * R]
        u = u * keep * scales.index_select(0, self.column_slots)[None, :]
        return (y.float() + u @ self.b).to(y.dtype)  # [num_tokens, out_features]


class XlaLoraTable:
    """The host table's slots on the device: `layers` and `scales` as LoraStep reads them."""

    def __init__(self, host: LoraTable, device: torch.device) -> None:
        self.host = host
        self.device = device
        self.max_loras = host.max_loras
        self.layers = [
            {name: XlaProjectionLora(projection, device) for name, projection in layer.items()}
            for layer in host.layers
        ]
        self.scales = host.scales.to(device)  # float32 [max_loras]
        runtime.sync()

    def refresh(self) -> None:
        """Upload every slot again, from the host table (an adapter was written into one)."""
        for layer in self.layers:
            for projection in layer.values():
                projection.refresh()
        self.scales = self.host.scales.to(self.device)
        runtime.sync()
