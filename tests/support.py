"""Small helpers shared by the test suites."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def eventually(predicate: Callable[[], bool], within_s: float = 5.0) -> None:
    """Wait until ``predicate()`` holds, polling: the things tests wait on have no event."""
    for _ in range(int(within_s / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"condition not reached within {within_s} s")
