"""The fake API server for benchmarks that are not asyncio themselves."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from testkit.apiserver import FakeApiServer

T = TypeVar("T")


class ApiThread:
    """The fake API server on an event loop of its own thread, so that it keeps serving while
    the benchmark's thread waits on a gRPC call or polls what a component wrote."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="fake-api", daemon=True)
        self._thread.start()
        self.fake: FakeApiServer = self.run(self._start())

    async def _start(self) -> FakeApiServer:
        fake = FakeApiServer()
        await fake.start()
        return fake

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=30)

    def call(self, function: Callable[[], T]) -> T:
        async def wrapped() -> T:
            return function()

        return self.run(wrapped())

    def close(self) -> None:
        self.run(self.fake.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
