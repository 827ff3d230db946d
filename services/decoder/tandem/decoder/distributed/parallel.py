"""Ranks, process groups and collectives: the only module that calls torch.distributed.

NOTE: two groups. The data plane (gloo on CPU, NCCL on CUDA) carries the model's collectives; a
separate gloo control group carries rank 0's step broadcasts, so control traffic is always host
memory and never queues behind, or deadlocks with, device collectives. Both groups have a timeout:
a rank that dies or hangs makes every other rank's next collective raise instead of wait forever.

World size 1 creates no group at all: the model and the runner take `ParallelContext | None` and
None means "one rank, no collectives". Nothing here is module-global: the context is passed down.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from tandem.decoder.backends import backend as backends
from tandem.decoder.distributed.step_broadcast import StepSender

# Recent torch names the tensor-in/tensor-out collectives *_single (2.13 warns on *_tensor); older
# releases have only *_tensor.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class RankInfo:
    """Where this process sits and how the ranks meet."""

    rank: int  # 0 runs the server, scheduler and sampler; the others run the worker loop
    world_size: int  # ranks the model is sharded over
    # "env://" under torchrun (its agent's store and variables), else rank 0's "tcp://host:port"
    init_method: str
    local_rank: int = 0  # index of this rank on its machine (selects the CUDA device)

    @property
    def is_torchrun(self) -> bool:
        return self.init_method == "env://"

    @classmethod
    def local(cls, rank: int, world_size: int, port: int) -> RankInfo:
        """A rank of a group spawned on this machine, meeting at 127.0.0.1:port."""
        return cls(rank, world_size, f"tcp://127.0.0.1:{port}", local_rank=rank)

    @classmethod
    def from_torchrun(cls, environ: dict[str, str]) -> RankInfo | None:
        """From torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT), or None."""
        if "RANK" not in environ or "WORLD_SIZE" not in environ:
            return None
        rank = int(environ["RANK"])
        return cls(rank, int(environ["WORLD_SIZE"]), "env://", int(environ.get("LOCAL_RANK", rank)))


def free_port() -> int:
    """A TCP port nobody listens on now at any address (for a local spawn's rendezvous): torch's
    TCPStore listens on every interface, so a port free on 127.0.0.1 alone (held on 127.0.0.2, or
    on ::1) failed its start with EADDRINUSE. The kernel's pick for the wildcard, dual-stack where
    the machine has IPv6, is free at every address."""
    for family, wildcard in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((wildcard, 0))
                return s.getsockname()[1]
        except OSError:
            continue
    raise OSError("no TCP port can be bound on this machine")


class ControlGroup:
    """Broadcasts from rank 0 on the gloo control group; tensors are host tensors."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def broadcast(self, x: torch.Tensor, within_s: float | None = None) -> torch.Tensor:
        """Rank 0 sends `x`; the others receive into it (same shape and dtype) and get it back.
        `within_s`: rank 0 waits that long at most (_wait_within)."""
        work = dist.broadcast(x, src=0, group=self.group, async_op=within_s is not None)
        if within_s is not None:
            _wait_within(work, within_s)
        return x

    def all_gather(self, x: torch.Tensor, within_s: float | None = None) -> torch.Tensor:
        """Every rank's `x` (the same shape and dtype on each) in rank order: [world_size, *x.shape].
        `within_s`: this rank waits that long at most (_wait_within), the result then unread."""
        world_size = dist.get_world_size(self.group)
        out = x.new_empty(world_size * x.numel())  # gloo gathers along dim 0 only
        work = _all_gather_single(
            out, x.contiguous().flatten(), group=self.group, async_op=within_s is not None
        )
        if within_s is not None:
            _wait_within(work, within_s)
        return out.view(world_size, *x.shape)


def _wait_within(work: dist.Work, within_s: float) -> None:
    """Rank 0's word that it failed, which must not hold its exit for the group timeout when a rank
    cannot take it now (still loading, inside a step's collective, hung): raises TimeoutError after
    `within_s`. The operation stays queued, so a rank that reaches it later, while this process lives,
    still gets the word; one gone fails it (the RuntimeError raised at once)."""
    try:
        work.wait(timedelta(seconds=within_s))
    except RuntimeError:
        if work.is_completed():  # failed, not late: a rank gone
            raise
        raise TimeoutError(f"not every rank took it within {within_s:g} s") from None


class ParallelContext:
    """This rank's view of the data-plane group: sharding coordinates and the model's collectives.

    Sequence collectives work on dim 0 (tokens); rank r owns rows [r * local_len, (r + 1) * local_len).
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        group: dist.ProcessGroup | None,
        control: ControlGroup,
        timeout_s: float,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        # The rank as a 0-dim tensor: sequence windows computed from it are the same graph on every
        # rank (a traced SPMD program cannot take the Python int); 0-dim, so it mixes with any device.
        self.rank_tensor = torch.tensor(rank, dtype=torch.int64)
        self.group = group  # data plane; None = the default group
        self.control = control  # rank 0's step broadcasts
        self.timeout_s = timeout_s  # any collective waiting longer than this raises

    def all_gather_control(self, x: torch.Tensor, within_s: float | None = None) -> torch.Tensor:
        """Every rank's host tensor `x`, stacked in rank order ([world_size, *x.shape]), on the control
        group: what the ranks tell each other at start (kv_pool_agreement.py), never a step's data.
        `within_s`: this rank waits that long at most (ControlGroup.all_gather)."""
        return self.control.all_gather(x, within_s)

    def step_sender(self) -> StepSender:
        """Rank 0's feed of every step to the other ranks' worker loops, on the control group."""
        return StepSender(self.control)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place. x: any shape, the same on every rank.

        NOTE: one order of addition per element, whatever the call holds. Two ranks' sum is a + b,
        the same bits in either order. From three, gloo's ring cuts the buffer into chunks by its
        size, so where an element's chunk starts, and so its order of addition, depends on how many
        rows share the call (3 ranks, a row alone or among 4: 137 of its 576 float32 elements
        differed): speculation's 1 + K verify rows summed other bits than plain decoding's one row.
        There each rank's share is gathered and summed here in rank order (in float32 for narrower
        dtypes, rounded once), at world_size times the bytes moved.
        """
        if self.world_size <= 2:
            dist.all_reduce(x, group=self.group)
            return x
        shares = x.new_empty((self.world_size * x.numel(),))  # gloo gathers along one flat dim
        _all_gather_single(shares, x.contiguous().flatten(), group=self.group)
        return x.copy_(_in_rank_order(shares.view(self.world_size, *x.shape)))

    def all_gather_seq(self, x: torch.Tensor) -> torch.Tensor:
        """[local_len, ...] -> [local_len * world_size, ...], rank order along dim 0."""
        out = x.new_empty((x.shape[0] * self.world_size, *x.shape[1:]))
        _all_gather_single(out, x.contiguous(), group=self.group)
        return out

    def reduce_scatter_seq(self, x: torch.Tensor) -> torch.Tensor:
        """[num_tokens, ...] partial sums -> this rank's window [num_tokens / world_size, ...] of the sum.

        From three ranks, the sum all_reduce makes (its NOTE): each rank is sent its window of every
        rank's partials and adds them in rank order, so a decode row in a sequence-parallel step (one
        with a prompt chunk) has the bits it has in a decode-only step; gloo's reduce-scatter added
        them in its own order (3 ranks: 170 of 576 float32 elements of a row differed), and default-mode
        speculation left plain decoding beside a neighbour's prefill. The same bytes move.
        """
        local_len = x.shape[0] // self.world_size
        if self.world_size <= 2:
            out = x.new_empty((local_len, *x.shape[1:]))
            _reduce_scatter_single(out, x.contiguous(), group=self.group)
            return out
        x = x.contiguous()  # gloo writes the shares row-major whatever x's layout: so is the buffer
        shares = torch.empty_like(x)  # [world_size * local_len, ...]: rank r's partials of my window
        dist.all_to_all_single(shares, x, group=self.group)
        return _in_rank_order(shares.view(self.world_size, local_len, *x.shape[1:]))

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] -> [..., n * world_size], rank order along the last dim (vocab-parallel logits)."""
        stacked = self.all_gather_seq(x).view(self.world_size, *x.shape)  # [world_size, ..., n]
        return torch.cat(stacked.unbind(0), dim=-1)


def _in_rank_order(shares: torch.Tensor) -> torch.Tensor:
    """[world_size, ...] -> their sum, added in rank order: in float32 for narrower floating dtypes
    (rounded once), integers as integers (float32 rounded 2**25 + 1)."""
    dtype = shares.dtype
    wide = torch.promote_types(dtype, torch.float32) if dtype.is_floating_point else dtype
    total = shares[0].to(wide, copy=True)
    for share in shares[1:]:
        total += share
    return total.to(dtype)


def init_parallel(info: RankInfo, device: str, timeout_s: float) -> ParallelContext:
    """Joins the group (blocks until every rank has), returns this rank's context.

    `device` picks the data-plane backend (`backends/backend.py`: NCCL for CUDA, gloo on CPU).
    """
    if info.world_size < 2:
        raise ValueError("init_parallel is for world_size >= 2; one rank needs no process group")
    timeout = timedelta(seconds=timeout_s)
    backend = backends.resolve(device)
    if backend.collective_backend is None:
        raise ValueError(f"device {backend.name} runs on one rank only")
    backends.bind_rank_device(device)
    dist.init_process_group(
        backend.collective_backend,
        init_method=info.init_method,
        rank=info.rank,
        world_size=info.world_size,
        timeout=timeout,
    )
    control = dist.new_group(backend="gloo", timeout=timeout)
    return ParallelContext(info.rank, info.world_size, None, ControlGroup(control), timeout_s)


def destroy_parallel() -> None:
    """Leaves the groups (best effort: a dead peer must not keep this process alive)."""
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # on the way out after a failure: nothing is left to save
            pass
