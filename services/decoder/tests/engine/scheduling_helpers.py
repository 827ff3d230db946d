"""Small builders and a fake runner for the request / KV cache / scheduler tests (no model).

`FakeRunner` stands in for the model: it writes each scheduled position's key into a dict keyed by
KV slot (block_id * block_size + offset), as the real paged cache would, then reads back every
position the step attends to and checks it is that request's own content. A wrong block table, a
prefix-cache hit on the wrong block, or a write into a shared block therefore fails loudly. The
sampled token depends only on (request id, number of outputs so far), so a request's outputs have
one right answer whatever the batching, chunking or preemption; `reference_outputs` gives it.
A step that verifies proposed tokens samples every one of its positions the same way, and
`run_step` keeps the samples the proposal got right, as the engine does.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable

from tandem.decoder.engine.params import StoppingParams
from tandem.decoder.engine.request import EmbeddingSegment, Request, RequestStatus, Segment, TokenSegment
from tandem.decoder.engine.sampling.prompt_lookup import verified_tokens
from tandem.decoder.engine.scheduling.scheduler import Scheduler
from tandem.decoder.engine.scheduling.step_plan import StepPlan

VOCAB_SIZE = 50


def digest(label: str) -> bytes:
    return hashlib.blake2b(label.encode(), digest_size=16).digest()


def embedding(labels: list[str]) -> EmbeddingSegment:
    """An embedding segment whose row i is identified by labels[i] (rows stay a stand-in object)."""
    return EmbeddingSegment(rows=object(), num_rows=len(labels), digests=[digest(x) for x in labels])


def make_request(
    request_id: str,
    prompt: list[int] | list[Segment],
    max_new_tokens: int = 4,
    arrival_time: float | None = None,
    caller: str = "",
) -> Request:
    """A request from token ids, or from a list of segments."""
    segments: list[Segment] = (
        [TokenSegment(prompt)] if all(isinstance(x, int) for x in prompt) else prompt  # type: ignore[list-item]
    )
    request = Request.from_segments(
        request_id,
        segments,
        stopping=StoppingParams(max_new_tokens=max_new_tokens),
        arrival_time=arrival_time,
    )
    request.caller = caller
    return request


def fake_token(request_id: str, index: int) -> int:
    return hashlib.blake2b(f"{request_id}/{index}".encode(), digest_size=4).digest()[0] % VOCAB_SIZE


def reference_outputs(request_id: str, num_tokens: int) -> list[int]:
    return [fake_token(request_id, i) for i in range(num_tokens)]


def expected_key(request: Request, position: int) -> object:
    if position >= request.num_tokens:  # a proposed token, verified this step
        return ("t", request.draft_token_ids[position - request.num_tokens])
    if position >= request.num_prompt_tokens:
        return ("t", request.output_token_ids[position - request.num_prompt_tokens])
    if request.is_token_ids[position]:
        return ("t", request.prompt_token_ids[position])
    return ("e", request.embedding_digests[position])


class FakeRunner:
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.block_size = scheduler.block_manager.block_size
        self.kv: dict[int, object] = {}  # slot -> what was written there

    def execute(self, plan: StepPlan) -> dict[str, list[int]]:
        """One sample per sampled position: 1 + num_draft_tokens per request that needs logits."""
        sampled: dict[str, list[int]] = {}
        block_manager = self.scheduler.block_manager
        for item in plan.scheduled:
            request = item.request
            assert 0 not in item.block_ids, "the null block must never be in a block table"
            for position in range(item.start, item.end):
                block_id = item.block_ids[position // self.block_size]
                assert block_manager.ref_count(block_id) == 1, f"write into shared block {block_id}"
                self.kv[self._slot(item.block_ids, position)] = expected_key(request, position)
            for position in range(item.end):  # attention reads the whole prefix
                got = self.kv.get(self._slot(item.block_ids, position))
                assert got == expected_key(request, position), (item.request_id, position, got)
            if item.needs_logits:
                n = request.num_output_tokens
                sampled[item.request_id] = [
                    fake_token(item.request_id, n + j) for j in range(1 + item.num_draft_tokens)
                ]
        return sampled

    def _slot(self, block_ids: tuple[int, ...], position: int) -> int:
        return block_ids[position // self.block_size] * self.block_size + position % self.block_size


def check_invariants(scheduler: Scheduler, plan: StepPlan) -> None:
    """What must hold after every schedule(), whatever the workload."""
    config = scheduler.config
    block_manager = scheduler.block_manager
    ids = [item.request_id for item in plan.scheduled]
    assert len(ids) == len(set(ids)), "a request scheduled twice in one step"
    assert len(ids) <= config.max_num_seqs
    # Each verified proposed token attends as a row of its own.
    num_rows = len(ids) + sum(item.num_draft_tokens for item in plan.scheduled)
    assert config.max_num_rows is None or num_rows <= config.max_num_rows
    assert plan.num_batched_tokens == sum(item.num_new_tokens for item in plan.scheduled)
    assert plan.num_batched_tokens <= config.max_num_batched_tokens
    assert all(item.num_new_tokens >= 1 for item in plan.scheduled)
    for item in plan.scheduled:
        assert item.end <= item.request.num_tokens + item.num_draft_tokens
        assert item.num_draft_tokens == 0 or (item.needs_logits and item.start == item.request.num_tokens - 1)
    assert plan.num_free_blocks_after == block_manager.num_free_blocks
    assert all(not request.block_ids for request in scheduler.waiting)
    assert all(not request.block_ids for request in scheduler.paused.values())
    assert all(request.status is RequestStatus.PAUSED for request in scheduler.paused.values())
    assert all(request.status is RequestStatus.RUNNING for request in scheduler.running)
    for item in plan.scheduled:
        capacity = len(item.request.block_ids) * block_manager.block_size
        assert capacity >= item.end, "blocks must cover every position the step writes"

    holders: Counter[int] = Counter(b for request in scheduler.running for b in request.block_ids)
    assert 0 not in holders
    for block_id in range(1, block_manager.num_total_blocks + 1):
        assert block_manager.ref_count(block_id) == holders[block_id] >= 0
    assert block_manager.num_free_blocks + len(holders) == block_manager.num_total_blocks
    for request in scheduler.running:
        num_full_computed = request.num_computed_tokens // block_manager.block_size
        for index, block_id in enumerate(request.block_ids):
            if holders[block_id] > 1:  # shared only through the prefix cache: full, computed, read-only
                assert index < num_full_computed, (request.request_id, index, block_id)


Proposer = Callable[[Request], list[int]]  # a decoding request's guess at its next tokens


def run_step(scheduler: Scheduler, runner: FakeRunner, propose: Proposer | None = None) -> StepPlan:
    """One engine step: propose, schedule, check, run, verify, update, then stop requests at
    max_new_tokens."""
    if propose is not None:
        for request in scheduler.running:
            if request.num_computed_tokens == request.num_tokens - 1:
                request.draft_token_ids = propose(request)
    plan = scheduler.schedule()
    check_invariants(scheduler, plan)
    samples = runner.execute(plan)
    for item in plan.scheduled:
        if item.needs_logits:
            proposal = item.request.draft_token_ids[: item.num_draft_tokens]
            samples[item.request_id] = verified_tokens(proposal, samples[item.request_id])
    scheduler.update(plan, samples)
    for item in plan.scheduled:
        request = item.request
        if item.needs_logits and request.num_output_tokens >= request.stopping.max_new_tokens:
            scheduler.finish(item.request_id, RequestStatus.FINISHED_LENGTH)
    return plan


def run_until_done(
    scheduler: Scheduler, runner: FakeRunner, max_steps: int = 10_000, propose: Proposer | None = None
) -> list[StepPlan]:
    plans = []
    while scheduler.has_unfinished:
        assert len(plans) < max_steps, "requests did not finish: the scheduler is stuck"
        plans.append(run_step(scheduler, runner, propose))
    return plans
