"""The engine core's grammar budget of a step (`EngineCore._over_grammar_budget`): which requests a step's
grammar work fails, given each one's seconds and its matcher's rebuilds'."""

from __future__ import annotations

from types import SimpleNamespace

from tandem.decoder.engine.step.core import EngineCore

LIMIT_S = 0.250
HEAVY_MASK_S = 0.010


def _item(request_id: str, mask_seconds: float) -> SimpleNamespace:
    constraint = SimpleNamespace(mask_seconds=mask_seconds, field="structured.grammar")
    return SimpleNamespace(
        request_id=request_id, request=SimpleNamespace(constraint=constraint), num_draft_tokens=0
    )


def _failed(grammar_seconds: dict[str, float], rebuild_seconds: dict[str, float]) -> list[str]:
    core = SimpleNamespace(max_grammar_seconds_per_step=LIMIT_S, heavy_mask_seconds=HEAVY_MASK_S)
    items = [_item("heavy", 0.110), _item("light", 0.001)]
    failed = EngineCore._over_grammar_budget(core, items, grammar_seconds, rebuild_seconds, done=set())  # type: ignore[arg-type]
    return [item.request_id for item, _ in failed]


def test_a_light_requests_rebuild_does_not_fail_a_heavy_neighbour_that_fits() -> None:
    # The rebuild is metering's work, and a light request never fails for the budget: counted in the
    # step's total it failed the heavy one (220 ms of masks beside 1 ms + a 40 ms rebuild, limit 250).
    assert _failed({"heavy": 0.220, "light": 0.041}, {"light": 0.040}) == []


def test_a_heavy_requests_own_rebuild_counts_against_the_step() -> None:
    assert _failed({"heavy": 0.220 + 0.040, "light": 0.001}, {"heavy": 0.040}) == ["heavy"]
