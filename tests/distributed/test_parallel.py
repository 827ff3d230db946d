"""The ranks' sum (ParallelContext.all_reduce, and reduce_scatter_seq in sequence-parallel steps) adds
each element in one order whatever the call holds: a row's bits alone equal its bits among other rows
and in a sequence-parallel step, at 2 ranks (a + b) and from 3 (summed in rank order), which
speculation's exactness on several ranks rests on (its verify rows share a call, and land in steps
with or without a neighbour's prompt chunk)."""

from __future__ import annotations

import socket

import pytest
import torch

from tandem.decoder.distributed.parallel import ParallelContext, free_port
from tests.distributed.harness import run_ranks


def _row_alone_and_among_others(tp: ParallelContext, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    rows = torch.randn(6, 576, generator=torch.Generator().manual_seed(tp.rank)).to(dtype)  # this rank's
    alone, among = rows[:1].clone(), rows.clone()
    tp.all_reduce(alone)
    tp.all_reduce(among)
    shares = [torch.randn(6, 576, generator=torch.Generator().manual_seed(r)).to(dtype) for r in range(3)]
    in_rank_order = shares[0][:1].float()
    for share in shares[1 : tp.world_size]:
        in_rank_order += share[:1]
    # A sequence-parallel step's rows (reduce-scatter, a step with a prompt chunk) have the bits they
    # have summed whole (a decode-only step's all-reduce).
    window = rows.shape[0] // tp.world_size
    scattered = tp.reduce_scatter_seq(rows.clone())
    # Any layout: a transposed copy of the same values (gloo wrote the shares row-major into a buffer
    # laid out as x was, and the sum read the wrong elements).
    assert torch.equal(tp.reduce_scatter_seq(rows.t().contiguous().t()), scattered), dtype
    whole = tp.all_reduce(rows.clone())
    assert torch.equal(scattered, whole[tp.rank * window : (tp.rank + 1) * window]), dtype
    counts = torch.tensor([2**25 + 1])  # integers stay integers: float32 would round this sum
    tp.all_reduce(counts)
    assert counts.tolist() == [(2**25 + 1) * tp.world_size]
    return alone, among[:1], in_rank_order.to(dtype)


@pytest.mark.parametrize("world_size", [3])  # 2 ranks: a + b, which gloo adds as is
def test_a_rows_sum_has_the_same_bits_alone_and_among_other_rows(world_size: int) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        for alone, among, in_rank_order in run_ranks(_row_alone_and_among_others, world_size, dtype):
            assert torch.equal(alone, among), dtype
            assert torch.equal(alone, in_rank_order), dtype


def test_a_rendezvous_port_is_the_kernels_pick_for_the_wildcard_the_store_listens_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch's TCPStore listens on every interface: the port came from a pick on 127.0.0.1, free there
    alone, and one held on another address (127.0.0.2, ::1) failed the store's start with EADDRINUSE.
    A pick for the wildcard is free at every address; dual-stack "::" first, IPv4's where IPv6 is off."""
    binds: list[tuple[str, int]] = []
    real_socket = socket.socket

    class Recorded(real_socket):  # type: ignore[misc]
        def bind(self, address) -> None:  # type: ignore[no-untyped-def]
            binds.append(address[:2])
            super().bind(address)

    monkeypatch.setattr(socket, "socket", Recorded)
    port = free_port()
    assert binds[-1][0] in ("::", "0.0.0.0") and binds[0][0] == "::"
    with real_socket(socket.AF_INET, socket.SOCK_STREAM) as store:
        store.bind(("0.0.0.0", port))
