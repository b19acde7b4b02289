"""Request bodies: read within their limits, large ones parsed in pieces within a share of the
event loop, and all of them together held to a byte budget.

Every ordinary review waiting while the loop does one piece of work waits that long, so what a
body can make the loop do at once is bounded: a body over ``LARGE_BODY_BYTES`` is parsed as it
arrives (``webhook.jsonstream``), the pieces of all such bodies together taking at most
``LARGE_BODY_LOOP_SHARE`` of the loop (``LoopShare``); and the bytes of all bodies being read
or reviewed at once are bounded (``BodyBudget``), large ones paced, so that an abuser costs a
bounded amount of memory. The memory large bodies used is given back once none is in flight
(``webhook.heap``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

from aiohttp import web

from core.admission import AdmissionReview, ReviewError
from webhook import heap
from webhook.config import MIB, ServerLimits
from webhook.jsonstream import JSONError, JSONStream
from webhook.metrics import AdmissionMetrics

# Bodies above this may hold only half of the in-flight budget together, and are parsed in
# pieces; ordinary pods are far below it.
LARGE_BODY_BYTES = MIB
# The share of the event loop that parsing large bodies may take, all of them together: an
# 8 MiB pod costs about 30 ms of parsing in pieces, a document of one-byte tokens over a second.
LARGE_BODY_LOOP_SHARE = 0.25
# How much parsing may run ahead of that share before a piece waits.
LOOP_SHARE_BURST_S = 0.005
# A large body is parsed in pieces sized to take about this long each (between the sizes
# below): the cost per byte differs fiftyfold between long strings and one-digit numbers.
PIECE_TARGET_S = 0.0005
MIN_PIECE_BYTES = 1024
FIRST_PIECE_BYTES = 16 * 1024
MAX_PIECE_BYTES = 64 * 1024
# After the last large body is answered, wait this long for another before giving memory back.
TRIM_DELAY_S = 1.0


class BodyTooLarge(Exception):
    """A body over the limit: answered 413 before it is read."""


async def read_body(request: web.Request, limit: int) -> bytes:
    """The body, refused as soon as it grows past ``limit``. Joined once from the chunks as they
    arrived: ``Request.read`` grows a bytearray and copies it again, which for a large body
    costs the event loop several milliseconds more in one piece."""
    chunks = [chunk async for chunk in _chunks(request, limit)]
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def _chunks(request: web.Request, limit: int) -> AsyncIterator[bytes]:
    """The body's chunks as they arrive, until it grows past ``limit`` (then BodyTooLarge)."""
    size = 0
    async for chunk in request.content.iter_any():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge
        yield chunk


async def read_review_in_pieces(
    request: web.Request, limit: int, share: LoopShare
) -> AdmissionReview:
    """A large body parsed as it arrives, a piece at a time within ``share``: never held whole
    as bytes, and never costing the event loop more than one piece at once."""
    stream = JSONStream()
    piece = FIRST_PIECE_BYTES
    try:
        async for chunk in _chunks(request, limit):
            start = 0
            while start < len(chunk):
                spent = await share.run(stream.feed, chunk[start : start + piece])
                start += piece
                piece = _next_piece(piece, spent)
        value = stream.close()
    except JSONError as exc:
        raise ReviewError(f"not an AdmissionReview: body: Invalid JSON: {exc}") from None
    return AdmissionReview.from_value(value)


def _next_piece(size: int, spent: float) -> int:
    """The next piece's size: halved after a piece that took over twice the target, doubled
    after one that took under half."""
    if spent > 2 * PIECE_TARGET_S:
        return max(MIN_PIECE_BYTES, size // 2)
    if spent < PIECE_TARGET_S / 2:
        return min(MAX_PIECE_BYTES, size * 2)
    return size


class LoopShare:
    """Runs pieces of work one at a time so that together they take at most ``share`` of the
    event loop's time (a token bucket of loop seconds, ``burst`` deep), yielding to the loop
    after each piece so that whatever else is ready runs in between."""

    def __init__(self, share: float, burst: float) -> None:
        self.share = share
        self.burst = burst
        self._tokens = burst
        self._stamp: float | None = None
        self._turn = asyncio.Lock()

    async def run(self, work: Callable[[bytes], None], piece: bytes) -> float:
        """Runs ``work(piece)`` in its turn; the seconds it took."""
        async with self._turn:
            loop = asyncio.get_running_loop()
            now = loop.time()
            if self._stamp is not None:
                self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.share)
            self._stamp = now
            if self._tokens < 0:
                await asyncio.sleep(-self._tokens / self.share)
                self._tokens, self._stamp = 0.0, loop.time()
            started = time.perf_counter()
            try:
                work(piece)
            finally:
                spent = time.perf_counter() - started
                self._tokens -= spent
        await asyncio.sleep(0)
        return spent


class BodyBudget:
    """Bytes of request bodies being read or reviewed at once, by declared size.

    A body holds its share from before it is read until its answer is built (the parsed pod is
    several times the size of its JSON). Bodies over ``LARGE_BODY_BYTES`` may hold only half of
    the budget together, so a flood of them never makes an ordinary review wait for room; and
    they are let in one at a time at ``large_body_bytes_per_second``, because each costs the
    event loop milliseconds in one piece (parsing), which every review waiting then shares. No
    ordinary pod comes near that size: only an exceptional pod or an abuser waits here.
    """

    def __init__(self, limits: ServerLimits, metrics: AdmissionMetrics) -> None:
        self.total = limits.max_inflight_body_bytes
        self.large_total = self.total // 2
        self.used = 0
        self.large_used = 0
        self._metrics = metrics
        self._changed = asyncio.Condition()
        self._trim: asyncio.TimerHandle | None = None
        self._trimming: asyncio.Future[None] | None = None  # held: an unreferenced task may vanish
        self._rate = limits.large_body_bytes_per_second
        self._burst = max(limits.max_body_bytes, self._rate)
        self._tokens = float(self._burst)
        self._stamp: float | None = None
        self._pacing = asyncio.Lock()

    def _fits(self, size: int, large: bool) -> bool:
        if large and self.large_used + size > self.large_total:
            return False
        return self.used + size <= self.total

    async def _pace(self, size: int) -> None:
        async with self._pacing:
            loop = asyncio.get_running_loop()
            while True:
                now = loop.time()
                if self._stamp is not None:
                    self._tokens = min(self._burst, self._tokens + (now - self._stamp) * self._rate)
                self._stamp = now
                if self._tokens >= size:
                    self._tokens -= size
                    return
                await asyncio.sleep((size - self._tokens) / self._rate)

    @contextlib.asynccontextmanager
    async def hold(self, size: int) -> AsyncIterator[None]:
        large = size > LARGE_BODY_BYTES
        if large:
            await self._pace(size)
        async with self._changed:
            await self._changed.wait_for(lambda: self._fits(size, large))
            self.used += size
            self.large_used += size if large else 0
            self._metrics.inflight_body_bytes.set(self.used)
        try:
            yield
        finally:
            self.used -= size
            self.large_used -= size if large else 0
            self._metrics.inflight_body_bytes.set(self.used)
            if large and not self.large_used and self._trim is None:
                self._trim = asyncio.get_running_loop().call_later(TRIM_DELAY_S, self._give_back)
            async with self._changed:
                self._changed.notify_all()

    def _give_back(self) -> None:
        """Returns the memory large bodies used to the system once none is in flight. Their
        bytes and parsed objects are freed, but the C allocator keeps freed pages inside its
        heap for reuse, and a replica's resident memory would stay near its peak for good.
        Trimming a fragmented heap takes tens of milliseconds: it runs on a thread (ctypes
        releases the GIL), so only an allocation that needs the allocator's lock meanwhile
        waits, not the event loop."""
        self._trim = None
        if self.large_used or not heap.trim_available():
            return
        self._trimming = asyncio.ensure_future(asyncio.to_thread(heap.trim))
