"""Request bodies on their own (webhook/bodies.py: read within the limit, the byte budget) and
the heap memory given back after large ones (webhook/heap.py). Bodies through the running
server are tests/test_webhook_server.py's."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, cast

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from webhook import heap
from webhook.bodies import LARGE_BODY_BYTES, BodyBudget, BodyTooLarge, read_body
from webhook.config import MIB, ServerLimits
from webhook.metrics import AdmissionMetrics


class _Content:
    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks

    async def iter_any(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            yield chunk


class _Request:
    def __init__(self, chunks: list[bytes]) -> None:
        self.content = _Content(chunks)


def _request(chunks: list[bytes]) -> web.Request:
    return cast(web.Request, _Request(chunks))


@pytest.mark.parametrize(
    ("chunks", "limit", "body"),
    [
        pytest.param([], 10, b"", id="empty"),
        pytest.param([b"abc"], 10, b"abc", id="one-chunk"),
        pytest.param([b"ab", b"cd", b"e"], 5, b"abcde", id="joined-at-the-limit"),
        pytest.param([b"abc", b"def"], 5, None, id="past-the-limit"),
    ],
)
async def test_read_body(chunks: list[bytes], limit: int, body: bytes | None) -> None:
    if body is None:
        with pytest.raises(BodyTooLarge):
            await read_body(_request(chunks), limit)
    else:
        assert await read_body(_request(chunks), limit) == body


def _budget(**limits: Any) -> BodyBudget:
    return BodyBudget(ServerLimits(**limits), AdmissionMetrics(CollectorRegistry()))


@pytest.mark.parametrize(
    ("sizes", "used", "large_used"),
    [
        pytest.param([1024, 2048], 3072, 0, id="ordinary-bodies"),
        pytest.param([2 * MIB, 1024], 2 * MIB + 1024, 2 * MIB, id="one-large-body"),
    ],
)
async def test_budget_counts_what_is_held(sizes: list[int], used: int, large_used: int) -> None:
    budget = _budget()
    async with budget.hold(sizes[0]), budget.hold(sizes[1]):
        assert (budget.used, budget.large_used) == (used, large_used)
    assert (budget.used, budget.large_used) == (0, 0)


async def test_large_bodies_hold_only_half_of_the_budget() -> None:
    # Paced fast enough that only the budget makes the second large body wait.
    budget = _budget(
        max_body_bytes=8 * MIB,
        max_inflight_body_bytes=16 * MIB,
        large_body_bytes_per_second=64 * MIB,
    )
    size = 8 * MIB
    assert size > LARGE_BODY_BYTES
    second = budget.hold(size)
    async with budget.hold(size):
        entering = asyncio.ensure_future(second.__aenter__())
        await asyncio.sleep(0.05)
        assert not entering.done()  # half the budget is 8 MiB: the second large body waits
        async with budget.hold(1024):  # an ordinary one still finds room
            assert budget.used == size + 1024
    await asyncio.wait_for(entering, 5)
    assert budget.large_used == size
    await second.__aexit__(None, None, None)
    assert budget.used == 0


def test_heap_calls_are_safe_on_any_c_library() -> None:
    heap.return_large_blocks_at_once()
    heap.trim()
    assert isinstance(heap.trim_available(), bool)
