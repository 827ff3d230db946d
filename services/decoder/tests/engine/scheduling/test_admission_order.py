"""AdmissionOrder: fewest running first, then the oldest turn, then queue order; FCFS within a caller."""

from __future__ import annotations

from services.decoder.tests.engine.scheduling_helpers import make_request
from tandem.decoder.engine.scheduling.admission_order import AdmissionOrder


def _drain(order: AdmissionOrder) -> list[str]:
    names = []
    while (request := order.next()) is not None:
        order.admitted(request)
        names.append(request.request_id)
    return names


def test_one_caller_is_first_come_first_served() -> None:
    waiting = [make_request(f"r{i}", [1, 2]) for i in range(5)]
    assert _drain(AdmissionOrder(waiting, running=[])) == ["r0", "r1", "r2", "r3", "r4"]


def test_the_caller_running_fewest_goes_first_and_callers_alternate() -> None:
    running = [make_request("a0", [1], caller="a")]
    waiting = [make_request(n, [1], caller=n[0]) for n in ("a1", "a2", "b1", "b2")]
    assert _drain(AdmissionOrder(waiting, running)) == ["b1", "a1", "b2", "a2"]


def test_among_callers_running_none_the_oldest_turn_goes_first() -> None:
    had_a_turn = make_request("a1", [1], caller="a")
    had_a_turn.admission_number = 7  # preempted for another caller after its turn
    waiting = [had_a_turn, make_request("b1", [1], caller="b"), make_request("c1", [1], caller="c")]
    assert _drain(AdmissionOrder(waiting, running=[])) == ["b1", "c1", "a1"]
