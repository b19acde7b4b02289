"""Small helpers shared by the test suites."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable


async def eventually(predicate: Callable[[], bool], within_s: float = 5.0) -> None:
    """Wait until ``predicate()`` holds, polling: the things tests wait on have no event."""
    for _ in range(int(within_s / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"condition not reached within {within_s} s")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now, for servers that must be told their port."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
