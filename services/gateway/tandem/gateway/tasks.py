"""Awaiting several calls at once without leaving any of them running for nobody."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any


async def all_or_cancel(awaitables: list[Awaitable[Any]]) -> list[Any]:
    """Every result, in order; the first failure cancels the rest (no work left running for nobody)
    and is raised as it is (gRPC errors keep their status). Cancelled itself, it cancels them all."""
    tasks = [asyncio.ensure_future(awaitable) for awaitable in awaitables]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        raise
