"""The answers the gateway holds: an answer reserves its bytes at once when they fit its caller's share
and the gateway's bound, else waits, first in first out, until bytes are given back; past its wait, a
429 naming --max-unread-answer-bytes-per-caller or a 503 naming --max-unread-answer-bytes. One over a
bound alone is reserved when nothing is held against it. A cancelled waiter holds nothing and leaves
no waiter. Settled, a reservation holds what its JSON took; released, it gives everything back, once."""

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


async def test_an_answer_over_a_bound_alone_is_reserved_when_nothing_is_held_against_it() -> None:
    held = AnswerBytes(max_bytes=1000, max_bytes_per_caller=400)
    over_share = await asyncio.wait_for(held.reserve("a", 900, 5), 1)  # a held nothing; fits the bound
    over_share.release()
    b = await held.reserve("b", 100, 5)
    over_bound = _waiting(held, "a", 1500)  # over the bound alone: once the gateway holds nothing
    await asyncio.sleep(0)
    assert not over_bound.done()
    b.release()
    assert (await asyncio.wait_for(over_bound, 1)).num_held == held.num_bytes == 1500


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
