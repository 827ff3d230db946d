"""Waiting, in a test, for what the gateway's background tasks make true."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def eventually(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Returns once `condition()` holds; TimeoutError after `timeout_s`."""
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.01)
