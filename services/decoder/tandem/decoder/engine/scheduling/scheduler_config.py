"""The scheduler's limits, validated when built, and its two refusals of a request. Pure Python.

`SchedulerConfig` bounds one step (requests, positions, attention rows, a neighbour's share) and the
waiting queue. `Scheduler.add_request` refuses with `QueueFullError` when the queue is at `max_waiting`
(the same request may succeed later), and with `RequestTooLongError` when the request could never fit
in the KV pool, whatever the load.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.client.errors import ErrorInfo, InvalidArgument, ResourceExhausted


class QueueFullError(ResourceExhausted):
    """The waiting queue holds `max_waiting` requests; the same request may succeed later."""


class RequestTooLongError(InvalidArgument, ValueError):
    """A request that could never run here, whatever the load: it needs more than `limit_name`."""

    def __init__(
        self, field: str, limit_name: str, limit: int, value: int, *, info: ErrorInfo | None = None
    ) -> None:
        super().__init__(field, f"needs {value} but {limit_name} is {limit}", info=info)
        self.limit_name = limit_name
        self.limit = limit
        self.value = value


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # requests in one step (running set size)
    max_num_batched_tokens: int = 2048  # token budget of one step, prefill and decode together
    max_waiting: int = 256  # waiting-queue bound; add_request raises QueueFullError beyond it
    # Most positions of one request per step; None = whatever is left of the step's budget. Set (with
    # a budget of max_num_seqs times it) a request's prefill chunks no longer depend on its neighbours.
    max_tokens_per_request: int | None = None
    # Most attention rows in one step: a request's prefill or decode is one, every proposed token it
    # verifies one more (each attends as a sequence of its own). Static shapes set it to the largest
    # sequence bucket; None = only the token budget bounds proposals.
    max_num_rows: int | None = None
    # Most requests in one step while a light caller (nothing waiting, at most this many running)
    # shares the batch with heavy ones (requests waiting, or more running: a flood beside a
    # neighbour): every request of the light callers runs each step, the heavy ones' take turns for
    # the rest. A step's time grows with its rows (on a CPU: attention over each row's context), so a
    # neighbour's tokens come at the pace of a narrow step, not of the flood's full batch. None =
    # every running request, every step.
    shared_step_seqs: int | None = None
    # Most positions of a prefill chunk while any decode shares the step, less the decode rows (below)
    # (vLLM's long_prefill_token_threshold; a step holding no decode is not capped): a step's
    # time grows with its positions (SmolLM2 on 2 CPU cores: 1-5 ms each), and a decoding request's next
    # token waits for the whole step. The chunk's share is the threshold less those rows, so that a
    # power-of-two threshold is a static-shape bucket, but never under half the threshold: with more
    # decode rows than that a prefill still advances half a threshold a step (at one position a step,
    # 520 decodes kept a 2,000-token prompt 2,000 steps from its first token). Each prefilling request
    # is capped so, and drafts come on top (a step may span more). None = off. A request's chunks then
    # depend on its neighbours, so it cannot be set with max_tokens_per_request.
    long_prefill_token_threshold: int | None = None
    # Positions a prefill chunk is padded up to where each chunk runs as a graph of its own, apart
    # from the step's decode rows (the XLA runner's prefill buckets, ascending). A capped chunk then
    # takes the largest of them within the threshold (the smallest if none is), the decode rows not
    # deducted: the threshold less them padded up to the next bucket, and 511 positions ran as a
    # 1,024-position graph (beside a decode, a 2,000-token prompt took 1.5x its uncapped time on XLA's
    # CPU device; 256-position chunks 1.06x). None: the chunk's share of one packed step, as above.
    prefill_buckets: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.shared_step_seqs is not None and self.shared_step_seqs < 1:
            raise ValueError(f"SchedulerConfig.shared_step_seqs must be >= 1, got {self.shared_step_seqs}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_waiting"):
            if getattr(self, name) < 1:
                raise ValueError(f"SchedulerConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_num_rows is not None and self.max_num_rows < self.max_num_seqs:
            raise ValueError(f"SchedulerConfig.max_num_rows must be >= max_num_seqs, got {self.max_num_rows}")
        if self.max_tokens_per_request is not None and self.max_tokens_per_request < 1:
            raise ValueError(
                f"SchedulerConfig.max_tokens_per_request must be >= 1, got {self.max_tokens_per_request}"
            )
        if self.prefill_buckets is not None and (
            not self.prefill_buckets
            or list(self.prefill_buckets) != sorted(set(self.prefill_buckets))
            or self.prefill_buckets[0] < 1
        ):
            raise ValueError(
                f"SchedulerConfig.prefill_buckets must be increasing sizes >= 1, got {self.prefill_buckets}"
            )
        if self.long_prefill_token_threshold is not None:
            if self.long_prefill_token_threshold < 1:
                raise ValueError(
                    "SchedulerConfig.long_prefill_token_threshold must be >= 1, got "
                    f"{self.long_prefill_token_threshold}"
                )
            if self.max_tokens_per_request is not None:
                raise ValueError(
                    "SchedulerConfig.long_prefill_token_threshold would make a request's chunks depend on "
                    "its neighbours, which max_tokens_per_request rules out"
                )
