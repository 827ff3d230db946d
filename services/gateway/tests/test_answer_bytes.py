"""The answers the gateway holds: a reservation fits one caller's share (429 beyond, naming
--max-unread-answer-bytes-per-caller) and the gateway's bound (503 beyond, naming
--max-unread-answer-bytes); settled, it holds what its JSON took, counting any bytes beyond it;
released, it gives everything back, once."""

from __future__ import annotations

from tandem.gateway.answer_bytes import AnswerBytes


def test_a_reservation_must_fit_the_callers_share_first_then_the_gateways_bound() -> None:
    held = AnswerBytes(max_bytes=1000, max_bytes_per_caller=400)
    a = held.reserve("a", 300)
    refused = held.refusal("a", 101)  # 401 of the caller's 400: its own, retried once it reads
    assert refused is not None and (refused.status, refused.type, refused.retry_after_s) == (
        429,
        "rate_limit_error",
        1.0,
    )
    assert "over 400 (--max-unread-answer-bytes-per-caller)" in refused.message
    assert held.refusal("a", 100) is None
    held.reserve("b", 400)
    held.reserve("c", 250)  # 950 held, no caller over its share
    refused = held.refusal("d", 51)
    assert refused is not None and (refused.status, refused.type) == (503, "service_unavailable")
    assert "over 1000 (--max-unread-answer-bytes, all callers together)" in refused.message
    assert held.refusal("d", 50) is None  # exactly the bound fits
    a.release()
    assert held.refusal("d", 350) is None and held.per_caller == {"b": 400, "c": 250}


def test_a_settled_reservation_holds_its_json_and_counts_json_beyond_it() -> None:
    held = AnswerBytes(max_bytes=1000, max_bytes_per_caller=1000)
    small = held.reserve("a", 500)
    small.hold(120)
    small.hold(30)
    assert held.num_bytes == 500  # within the reservation: nothing more
    small.settle()
    assert (held.num_bytes, held.per_caller["a"]) == (150, 150)  # the rest given back
    large = held.reserve("b", 100)
    large.hold(160)  # text longer than the reservation assumed: its excess is counted as made
    assert held.num_bytes == 150 + 160
    large.settle()
    assert held.num_bytes == 310
    for reservation in (small, large, small):  # released twice: given back once
        reservation.release()
    assert (held.num_bytes, held.per_caller) == (0, {})
