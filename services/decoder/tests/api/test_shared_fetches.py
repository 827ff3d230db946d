"""Shared fetches, with calls that are plain coroutines: a fetch asked for while one of its key runs
awaits that call; a key's call is forgotten once it ends, so a fetch after it calls again; an error
reaches every waiter as raised, and only an error `ran_out` names is called again, by a waiter whose
own time outlasts the call's."""

from __future__ import annotations

import asyncio

import pytest

from tandem.decoder.api.shared_fetches import SharedFetches


class Calls:
    """A call that keeps its timeout and ends when `gate` opens: the next of `errors` raised, or (None,
    or none left) its number as the result."""

    def __init__(self, *errors: Exception | None) -> None:
        self.gate = asyncio.Event()
        self.timeouts_s: list[float] = []
        self.errors = list(errors)

    async def __call__(self, timeout_s: float) -> str:
        self.timeouts_s.append(timeout_s)
        number = len(self.timeouts_s)
        await self.gate.wait()
        if self.errors and (error := self.errors.pop(0)) is not None:
            raise error
        return f"result {number}"


async def test_a_fetch_of_a_running_key_awaits_its_call_and_one_after_it_calls_again() -> None:
    fetches: SharedFetches[str] = SharedFetches()
    calls = Calls()
    together = [asyncio.ensure_future(fetches.fetch("k", 5, calls, lambda _: False)) for _ in range(3)]
    other = asyncio.ensure_future(fetches.fetch("other key", 5, calls, lambda _: False))
    await asyncio.sleep(0.01)
    calls.gate.set()
    assert await asyncio.gather(*together) == ["result 1"] * 3 and await other == "result 2"
    assert await fetches.fetch("k", 5, calls, lambda _: False) == "result 3"
    assert (fetches.num_started, fetches.num_joined) == (3, 2)


async def test_an_error_reaches_every_waiter_and_only_one_that_ran_out_is_called_again() -> None:
    fetches: SharedFetches[str] = SharedFetches()
    calls = Calls(ValueError("refused"))
    refused = [asyncio.ensure_future(fetches.fetch("k", t, calls, lambda _: False)) for t in (0.5, 30)]
    await asyncio.sleep(0.01)
    calls.gate.set()
    for waiter in refused:
        with pytest.raises(ValueError, match="refused"):
            await waiter
    assert len(calls.timeouts_s) == 1

    calls, ran_out = Calls(TimeoutError()), lambda error: isinstance(error, TimeoutError)
    hurried = asyncio.ensure_future(fetches.fetch("k", 0.5, calls, ran_out))
    patient = asyncio.ensure_future(fetches.fetch("k", 30, calls, ran_out))
    await asyncio.sleep(0.01)
    calls.gate.set()
    with pytest.raises(TimeoutError):
        await hurried  # its own time: nothing left to call again with
    assert await patient == "result 2"
    assert calls.timeouts_s[0] == 0.5 and 29 < calls.timeouts_s[1] < 30
