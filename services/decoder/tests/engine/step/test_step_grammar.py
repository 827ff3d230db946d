"""A step's grammar work (`step/step_grammar.py`): which rows its masks cover, the mask thread, and
which requests a step's grammar seconds fail for its budget, given each one's seconds and its
matcher's rebuilds'."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

from tandem.decoder.engine.sampling.grammar_growth import MatcherFull
from tandem.decoder.engine.step.step_grammar import MaskThread, masks_of, over_step_budget

LIMIT_S = 0.250
HEAVY_MASK_S = 0.010


def _item(request_id: str, mask_seconds: float) -> SimpleNamespace:
    constraint = SimpleNamespace(mask_seconds=mask_seconds, field="structured.grammar")
    return SimpleNamespace(
        request_id=request_id, request=SimpleNamespace(constraint=constraint), num_draft_tokens=0
    )


def _failed(grammar_seconds: dict[str, float], rebuild_seconds: dict[str, float]) -> list[str]:
    items = [_item("heavy", 0.110), _item("light", 0.001)]
    failed = over_step_budget(
        items,  # type: ignore[arg-type]
        grammar_seconds,
        rebuild_seconds,
        done=set(),
        max_seconds_per_step=LIMIT_S,
        heavy_mask_seconds=HEAVY_MASK_S,
    )
    return [item.request_id for item, _ in failed]


def test_a_light_requests_rebuild_does_not_fail_a_heavy_neighbour_that_fits() -> None:
    # The rebuild is metering's work, and a light request never fails for the budget: counted in the
    # step's total it failed the heavy one (220 ms of masks beside 1 ms + a 40 ms rebuild, limit 250).
    assert _failed({"heavy": 0.220, "light": 0.041}, {"light": 0.040}) == []


def test_a_heavy_requests_own_rebuild_counts_against_the_step() -> None:
    assert _failed({"heavy": 0.220 + 0.040, "light": 0.001}, {"heavy": 0.040}) == ["heavy"]


class _Constraint:
    """Masks every row alike, or fills (MatcherFull) when asked to."""

    def __init__(self, vocab_size: int, fills: bool = False) -> None:
        self.vocab_size = vocab_size
        self.fills = fills
        self.asked: list[list[int]] = []

    def masks_along(self, draft: list[int]) -> list[torch.Tensor]:
        self.asked.append(draft)
        if self.fills:
            raise MatcherFull
        return [torch.ones(self.vocab_size, dtype=torch.bool) for _ in range(1 + len(draft))]


def _scheduled(request_id: str, constraint: _Constraint | None, draft: list[int], needs_logits: bool = True):
    request = SimpleNamespace(constraint=constraint, draft_token_ids=[*draft, 99])  # 99: not scheduled
    return SimpleNamespace(
        request_id=request_id, request=request, num_draft_tokens=len(draft), needs_logits=needs_logits
    )


def test_masks_cover_every_sampled_row_in_order_and_none_of_a_chunk_that_samples_nothing() -> None:
    grammar = _Constraint(vocab_size=8)
    plan = SimpleNamespace(
        scheduled=[
            _scheduled("chunk", _Constraint(vocab_size=8), [], needs_logits=False),
            _scheduled("free", None, [5]),
            _scheduled("json", grammar, [3, 4]),
        ]
    )
    masks = masks_of(plan)  # type: ignore[arg-type]
    # free's 2 rows unmasked, then json's 3 (its row and one after each scheduled proposed token)
    assert [mask is None for mask in masks.allowed] == [True, True, False, False, False]
    assert grammar.asked == [[3, 4]]  # only the scheduled part of its proposal
    assert set(masks.seconds) == {"json"} and masks.full == set()


def test_a_full_matchers_rows_go_unmasked_and_it_is_named_full_with_no_seconds() -> None:
    plan = SimpleNamespace(scheduled=[_scheduled("full", _Constraint(8, fills=True), [1])])
    masks = masks_of(plan)  # type: ignore[arg-type]
    assert masks.allowed == [None, None]
    assert masks.full == {"full"} and masks.seconds == {}


@pytest.fixture
def mask_thread() -> Iterator[MaskThread]:
    mask_thread = MaskThread()
    yield mask_thread
    mask_thread.close()  # at teardown, passed or failed: a failed assertion left its thread running


def test_a_step_with_no_constrained_row_starts_no_mask_thread(mask_thread: MaskThread) -> None:
    before = {thread.name for thread in threading.enumerate()}
    free = SimpleNamespace(scheduled=[_scheduled("free", None, [])])
    unsampled = SimpleNamespace(scheduled=[_scheduled("chunk", _Constraint(8), [], needs_logits=False)])
    assert mask_thread.submit(free) is None  # type: ignore[arg-type]
    assert mask_thread.submit(unsampled) is None  # type: ignore[arg-type]
    started = {thread.name for thread in threading.enumerate()} - before
    assert not any(name.startswith("tandem-grammar") for name in started)
    constrained = SimpleNamespace(scheduled=[_scheduled("json", _Constraint(8), [])])
    future = mask_thread.submit(constrained)  # type: ignore[arg-type]
    assert future is not None and future.result(timeout=30).seconds.keys() == {"json"}
