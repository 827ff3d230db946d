"""A generation request: its prompt flattened to positions, its parameters, its scheduling state.

Pure Python (no torch, no grpc). A prompt is a list of segments, token ids or embedding rows; the
engine tokenizes text before a request is built, so only those two kinds reach this module. Every
prompt position is either a token id or one row of an embedding segment (`is_token_ids`); positions
after the prompt (sampled outputs) are always token ids. Embedding rows stay opaque here (a torch
tensor `[n, hidden_size]` in practice): the scheduler only needs each row's digest, which keys the
prefix cache.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tandem.client.errors import InvalidArgument
from tandem.decoder.engine.params import SamplingParams, StoppingParams


class InvalidPromptError(InvalidArgument, ValueError):
    """A prompt that cannot be served whatever the server's state (empty, inconsistent segments)."""


class RequestStatus(enum.Enum):
    WAITING = enum.auto()  # queued, never scheduled
    RUNNING = enum.auto()  # holds KV blocks and is scheduled every step
    PREEMPTED = enum.auto()  # blocks taken back; queued again and recomputes from position 0
    PAUSED = enum.auto()  # its reader is far behind: blocks taken back, not queued until resumed
    FINISHED_STOPPED = enum.auto()  # EOS, a stop token or a stop string
    FINISHED_LENGTH = enum.auto()  # max_new_tokens (or the model's context) reached
    FINISHED_ABORTED = enum.auto()  # cancelled by the client, a deadline or a shutdown

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED


_FINISHED = frozenset(
    {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED}
)


@dataclass(frozen=True)
class TokenSegment:
    """A run of prompt token ids."""

    ids: Sequence[int]  # [n] token ids, already checked against the vocabulary by the servicer


@dataclass(frozen=True)
class EmbeddingSegment:
    """A run of prompt positions given as rows in the model's hidden space."""

    rows: object  # [num_rows, hidden_size] tensor; never read by the scheduler
    num_rows: int  # number of positions this segment fills
    digests: Sequence[bytes]  # [num_rows] digest of each row's bytes (e.g. blake2b): prefix-cache keys


Segment = TokenSegment | EmbeddingSegment


@dataclass(frozen=True)
class EmbeddingSpan:
    """Where an embedding segment sits in the flattened prompt."""

    start: int  # first prompt position the rows fill
    end: int  # one past the last; end - start == number of rows
    rows: object  # [end - start, hidden_size] tensor, handed to the runner untouched


@dataclass(eq=False)
class Request:
    """One generation request and its scheduling state.

    Not frozen, unlike the messages between parts: the fields under "scheduling state" change every
    step, and the scheduler (with the block manager for `block_ids`) is their only writer. Equality is
    identity, so two requests with equal prompts stay distinct.
    """

    request_id: str  # the engine's key, unique for its life; never the caller's ID (events carry that)
    prompt_token_ids: list[int]  # [num_prompt_tokens] token id per position; 0 at embedding positions
    is_token_ids: list[bool]  # [num_prompt_tokens] True = token path, False = a row of an embedding span
    embedding_spans: list[EmbeddingSpan] = field(default_factory=list)  # in prompt order, disjoint
    embedding_digests: dict[int, bytes] = field(default_factory=dict)  # embedding position -> row digest
    sampling: SamplingParams = field(default_factory=SamplingParams)  # how tokens are picked
    stopping: StoppingParams = field(default_factory=StoppingParams)  # when the engine ends it
    arrival_time: float = field(default_factory=time.monotonic)  # time.monotonic(); queue-time metrics
    # Most tokens a decode step may propose for verification (prompt lookup); 0 = no speculation.
    num_speculative_tokens: int = 0
    # Who sent it: callers share the batch fairly (scheduling/admission_order.py); "" = anonymous.
    caller: str = ""
    # Structured output: the grammar's state (sampling/constraint.py's Constraint); None: unconstrained.
    constraint: Any = None
    # The LoRA adapter it names ("" = the base model); its slot and cache salt are set when it is
    # admitted (step/core.py, scheduling/adapters.py): -1 and b"" for the base model.
    adapter: str = ""
    adapter_slot: int = -1
    # The prefix cache's namespace (scheduling/kv_cache.py): requests of different salts never
    # share KV blocks.
    cache_salt: bytes = b""

    # Scheduling state.
    status: RequestStatus = RequestStatus.WAITING  # lifecycle; see RequestStatus
    output_token_ids: list[int] = field(default_factory=list)  # sampled so far; survives preemption
    num_computed_tokens: int = 0  # positions whose KV is in the cache; 0 again after a preemption
    num_cached_tokens: int = 0  # prompt positions served by the prefix cache at first admission
    block_ids: list[int] = field(default_factory=list)  # KV block table, written by the BlockManager
    # Prefix-cache chain hashes of its leading full blocks, memoized by the BlockManager: positions
    # never change once they exist, so these stay valid for the request's life, preemptions included.
    block_hashes: list[bytes] = field(default_factory=list)
    num_preemptions: int = 0  # times its blocks were taken back (metrics, tests)
    # Fair sharing between callers (Scheduler._yield_a_slot): num_tokens when last admitted, and
    # which admission that was (0: never admitted).
    num_tokens_at_admission: int = 0
    admission_number: int = 0
    last_step: int = 0  # the scheduler's step count when it last ran (Scheduler._sitting_out's turns)
    # Tokens proposed for the next decode step, verified with it (the engine writes them before
    # scheduling; the scheduler may shorten them to fit the step and clears them in update()).
    draft_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise InvalidPromptError("prompt", "must contain at least one token or embedding row")
        if len(self.is_token_ids) != len(self.prompt_token_ids):
            raise InvalidPromptError(
                "prompt",
                f"is_token_ids has {len(self.is_token_ids)} entries for "
                f"{len(self.prompt_token_ids)} positions",
            )
        # Spans come from `from_segments` with the digests, from the same rows: checking the digests
        # covers them (a separate span check could never fail).
        embedding_positions = {i for i, is_token in enumerate(self.is_token_ids) if not is_token}
        if set(self.embedding_digests) != embedding_positions:
            raise InvalidPromptError("prompt", "need exactly one digest per embedding position")

    @classmethod
    def from_segments(
        cls,
        request_id: str,
        segments: Sequence[Segment],
        sampling: SamplingParams | None = None,
        stopping: StoppingParams | None = None,
        arrival_time: float | None = None,
    ) -> Request:
        """Flatten segments into positions. Errors name the segment: `prompt[2].embeddings.digests`."""
        token_ids: list[int] = []
        is_token_ids: list[bool] = []
        spans: list[EmbeddingSpan] = []
        digests: dict[int, bytes] = {}
        for i, segment in enumerate(segments):
            if isinstance(segment, TokenSegment):
                token_ids.extend(segment.ids)
                is_token_ids.extend([True] * len(segment.ids))
                continue
            if len(segment.digests) != segment.num_rows:
                raise InvalidPromptError(
                    f"prompt[{i}].embeddings.digests",
                    f"need one digest per row: {len(segment.digests)} for {segment.num_rows} rows",
                )
            start = len(token_ids)
            # Empty segments are legal and contribute nothing, like an empty string.
            if segment.num_rows:
                spans.append(EmbeddingSpan(start, start + segment.num_rows, segment.rows))
            digests.update(zip(range(start, start + segment.num_rows), segment.digests, strict=True))
            token_ids.extend([0] * segment.num_rows)
            is_token_ids.extend([False] * segment.num_rows)
        return cls(
            request_id=request_id,
            prompt_token_ids=token_ids,
            is_token_ids=is_token_ids,
            embedding_spans=spans,
            embedding_digests=digests,
            sampling=sampling or SamplingParams(),
            stopping=stopping or StoppingParams(),
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
        )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus outputs: the target `num_computed_tokens` moves toward."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def is_scoring_prompt(self) -> bool:
        """Its prompt logprobs are asked for and not yet delivered: every prompt position must run (so
        no prefix-cache hit) and produce logits. They are delivered with the first sampled token, so
        a recompute after that (a preemption, a pause) scores nothing again."""
        return self.sampling.prompt_logprobs is not None and not self.output_token_ids
