"""The answers the gateway holds: an answer reserves its bytes at once when they fit its caller's share
and the gateway's bound, else waits, first in first out, until bytes are given back; past its wait, a
429 naming --max-unread-answer-bytes-per-caller when its caller's share (or queue) held it, or a 503
naming --max-unread-answer-bytes when the gateway's bound (or queue) did. One over its caller's share
alone is reserved when its caller holds nothing; one over the gateway's bound alone is refused at once
(413). A cancelled waiter holds nothing and leaves no waiter. Settled, a reservation holds what its
JSON took; released, it gives everything back, once."""

from __future__ import annotations

import asyncio

import pytest

from tandem.gateway.answer_bytes import AnswerBytes, Reservation
from tandem.gateway.errors import Refused


def _waiting(
    held: AnswerBytes, caller: str, num_bytes: int, timeout_s: float = 5
) -> asyncio.Task[Reservation]:
    return asyncio.create_task(held.reserve(caller, num_bytes, timeout_s))


async def test_an_answer_that_fits_is_reserved_at_once() -> None:
    held = AnswerBytes(max_bytes=1000, max_bytes_per_caller=400)
    await held.reserve("a", 400, 5)
    await held.reserve("b", 400, 5)
    await held.reserve("c", 200, 5)  # exactly the bound
    assert (held.num_bytes, dict(held.per_caller), len(held.waiters)) == (
        1000,
        {"a": 400, "b": 400, "c": 200},
        0,
    )


async def test_a_caller_over_its_share_waits_and_is_written_once_its_earlier_answer_is_read() -> None:
    held = AnswerBytes(max_bytes=1000, max_bytes_per_caller=400)
    first = await held.reserve("a", 300, 5)
    second = _waiting(held, "a", 200)
    await asyncio.sleep(0)
    assert not second.done() and held.per_caller["a"] == 300  # waits, holding nothing
    first.release()  # its earlier answer read
    assert (await second).num_held == 200 and held.per_caller["a"] == 200


async def test_a_neighbour_is_not_held_by_another_callers_waiting_answers() -> None:
    held = AnswerBytes(max_bytes=1000, max_bytes_per_caller=400)
    await held.reserve("a", 400, 5)
    waiting = _waiting(held, "a", 100)  # over a's share: waits
    await asyncio.sleep(0)
    await asyncio.wait_for(held.reserve("b", 400, 5), 1)  # served at once, though a's waits before it
    assert not waiting.done()
    waiting.cancel()


async def test_a_waiter_on_the_gateways_bound_is_not_overtaken() -> None:
    held = AnswerBytes(max_bytes=1000, max_bytes_per_caller=1000)
    a = await held.reserve("a", 900, 5)
    large = _waiting(held, "b", 500)
    await asyncio.sleep(0)
    small = _waiting(held, "c", 50)  # would fit, but the large one came first
    await asyncio.sleep(0)
    assert not large.done() and not small.done()
    a.release()
    await asyncio.wait_for(asyncio.gather(large, small), 1)
    assert dict(held.per_caller) == {"b": 500, "c": 50}


async def test_an_answer_over_its_callers_share_alone_is_reserved_when_its_caller_holds_nothing() -> None:
    held = AnswerBytes(max_bytes=1000, max_bytes_per_caller=400)
    b = await held.reserve("b", 100, 5)
    over_share = await asyncio.wait_for(held.reserve("a", 800, 5), 1)  # a held nothing; fits the bound
    over_share.release()
    a = await held.reserve("a", 100, 5)
    waiting = _waiting(held, "a", 800)  # once a holds nothing
    await asyncio.sleep(0)
    assert not waiting.done()
    a.release()
    assert (await asyncio.wait_for(waiting, 1)).num_held == 800 and held.num_bytes == 900
    b.release()


async def test_an_answer_over_the_gateways_bound_alone_is_refused_at_once_and_never_queued() -> None:
    held = AnswerBytes(max_bytes=1000, max_bytes_per_caller=400)
    with pytest.raises(Refused) as refused:
        await asyncio.wait_for(held.reserve("a", 1001, 5), 1)  # it could only wait for nobody to hold any
    error = refused.value.error
    assert (error.status, error.type, error.retry_after_s) == (413, "invalid_request_error", None)
    assert "1001 bytes, over 1000 (--max-unread-answer-bytes" in error.message
    for remedy in ("n", "max_tokens", "top_logprobs", "stream: true"):
        assert remedy in error.message
    assert (held.num_bytes, len(held.waiters)) == (0, 0)


async def test_a_waiter_held_by_its_callers_share_holds_no_other_caller_though_the_bound_holds_it_too() -> (
    None
):
    # hol.py: a caller keeps its own answer unread and asks one over its share alone that the gateway's
    # bound does not take now either; checked against the bound first it held every caller's answers
    # behind it for its whole wait, though only its own caller's unread answer keeps it waiting.
    held = AnswerBytes(max_bytes=1000, max_bytes_per_caller=400)
    await held.reserve("a", 300, 5)
    await held.reserve("b", 300, 5)
    over_share = _waiting(held, "a", 800)  # over a's share alone, and 1400 over the bound
    await asyncio.sleep(0)
    await asyncio.wait_for(asyncio.gather(held.reserve("c", 50, 5), held.reserve("d", 50, 5)), 1)
    assert not over_share.done()
    over_share.cancel()


async def test_past_its_wait_an_answer_is_refused_naming_what_it_waited_on() -> None:
    held = AnswerBytes(max_bytes=1000, max_bytes_per_caller=400)
    await held.reserve("a", 400, 5)
    with pytest.raises(Refused) as refused:
        await held.reserve("a", 1, 0.01)
    error = refused.value.error
    assert (error.status, error.type, error.retry_after_s) == (429, "rate_limit_error", 1.0)
    assert "hold 400 bytes and this answer takes 1 more, over 400 (--max-unread-answer-bytes-per-caller)" in (
        error.message
    )
    await held.reserve("b", 400, 5)
    with pytest.raises(Refused) as refused:
        await held.reserve("c", 201, 0.01)
    error = refused.value.error
    assert (error.status, error.type, error.retry_after_s) == (503, "service_unavailable", 1.0)
    assert "over 1000 (--max-unread-answer-bytes, all callers together)" in error.message
    assert "(--write-timeout-s)" in error.message
    assert (held.num_bytes, len(held.waiters)) == (800, 0)  # the refused held nothing, left nothing


async def test_an_answer_behind_its_callers_waiting_answer_is_refused_429_saying_so() -> None:
    # refusal.py: it fits a's share and the bound, but waits behind a's earlier answer, which waits
    # for a to hold nothing: a 503 naming the gateway's bound, with numbers under it, before.
    held = AnswerBytes(max_bytes=1000, max_bytes_per_caller=400)
    await held.reserve("a", 300, 5)
    earlier = _waiting(held, "a", 900)
    await asyncio.sleep(0)
    with pytest.raises(Refused) as refused:
        await held.reserve("a", 50, 0.01)
    error = refused.value.error
    assert (error.status, error.type, error.retry_after_s) == (429, "rate_limit_error", 1.0)
    assert "behind this caller's earlier answer" in error.message
    assert "(--max-unread-answer-bytes-per-caller)" in error.message
    assert "--max-unread-answer-bytes," not in error.message
    assert not earlier.done()
    earlier.cancel()


async def test_an_answer_behind_one_waiting_on_the_gateways_bound_is_refused_503_saying_so() -> None:
    held = AnswerBytes(max_bytes=1000, max_bytes_per_caller=1000)
    await held.reserve("a", 900, 5)
    large = _waiting(held, "b", 500)
    await asyncio.sleep(0)
    with pytest.raises(Refused) as refused:
        await held.reserve("c", 50, 0.01)  # fits, but the large one came first
    error = refused.value.error
    assert (error.status, error.type) == (503, "service_unavailable")
    assert "behind an earlier answer" in error.message
    assert "(--max-unread-answer-bytes, all callers together)" in error.message
    large.cancel()


async def test_a_waiter_cancelled_holds_nothing_leaves_no_waiter_and_lets_those_behind_it_in() -> None:
    held = AnswerBytes(max_bytes=1000, max_bytes_per_caller=1000)
    a = await held.reserve("a", 900, 5)
    large = _waiting(held, "b", 500)
    await asyncio.sleep(0)
    small = _waiting(held, "c", 100)  # behind the large one
    await asyncio.sleep(0)
    large.cancel()  # its caller went
    with pytest.raises(asyncio.CancelledError):
        await large
    assert (await asyncio.wait_for(small, 1)).num_held == 100
    assert (held.num_bytes, dict(held.per_caller), len(held.waiters)) == (1000, {"a": 900, "c": 100}, 0)
    a.release()


def test_a_settled_reservation_holds_its_json_and_is_given_back_once() -> None:
    held = AnswerBytes(max_bytes=1000, max_bytes_per_caller=1000)
    reservation = Reservation(held, "a")
    reservation.take(500)
    reservation.hold(120)
    reservation.hold(30)
    assert held.num_bytes == 500  # within the reservation: nothing more
    reservation.settle()
    assert (held.num_bytes, held.per_caller["a"]) == (150, 150)  # the rest given back
    for _ in range(2):  # released twice: given back once
        reservation.release()
    assert (held.num_bytes, held.per_caller) == (0, {})
