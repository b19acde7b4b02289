"""One event-loop thread for a threaded agent's API calls.

The device-plugin agent is threaded (gRPC runs kubelet's calls on worker threads, NVML's waits
block), yet its writers to the API server (the Node's labels and allocatable, the guard's
Events) are asyncio code over ``core.kube``. They all submit their calls here: one thread, one
loop, one client, instead of a loop per writer. A caller waits for its result with a timeout
(``call``) or not at all (``spawn``).

The client is made on first use and dropped after any failed call: the next call reads the
configuration afresh, which is how a rotated service-account token or a restarted API server
behind a dead keep-alive connection is picked up.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any, TypeVar

from core.kube import Api, kube_client

log = logging.getLogger(__name__)

T = TypeVar("T")
ApiCall = Callable[[Api], Awaitable[T]]
Spawn = Callable[[ApiCall[Any]], "concurrent.futures.Future[Any]"]


class ApiLoop:
    def __init__(self, kubeconfig: Path | None, *, name: str = "api-loop") -> None:
        self.kubeconfig = kubeconfig
        self.name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stack: AsyncExitStack | None = None
        self._api: Api | None = None
        self._opening = asyncio.Lock()  # concurrent first calls make one client

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()
        self._ready.wait()

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self._loop = loop
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(self._drop())
            loop.close()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Cancel what is in flight, close the client, end the thread."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None or not thread.is_alive():
            return

        def halt() -> None:
            for task in asyncio.all_tasks(loop):
                task.cancel()
            loop.call_soon(loop.stop)

        loop.call_soon_threadsafe(halt)
        thread.join(timeout=timeout_s)

    def spawn(self, call: ApiCall[T]) -> concurrent.futures.Future[T]:
        """Run ``call(api)`` on the loop; its future (the caller need not wait)."""
        if self._loop is None or not self.running:
            failed: concurrent.futures.Future[T] = concurrent.futures.Future()
            failed.set_exception(RuntimeError(f"{self.name} is not running"))
            return failed
        return asyncio.run_coroutine_threadsafe(self._with_api(call), self._loop)

    def submit(self, coroutine: Callable[[], Awaitable[T]]) -> concurrent.futures.Future[T]:
        """Run ``coroutine()`` on the loop without this loop's client: for a long watch, which
        keeps a client of its own (the loop's is dropped whenever any call fails)."""
        if self._loop is None or not self.running:
            failed: concurrent.futures.Future[T] = concurrent.futures.Future()
            failed.set_exception(RuntimeError(f"{self.name} is not running"))
            return failed
        return asyncio.run_coroutine_threadsafe(_awaited(coroutine()), self._loop)

    def call(self, call: ApiCall[T], timeout_s: float) -> T:
        """Run ``call(api)`` on the loop and wait for its result (its exception is raised here;
        TimeoutError after ``timeout_s``, the call then cancelled)."""
        future = self.spawn(call)
        try:
            return future.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"API call through {self.name} took over {timeout_s} s") from None

    async def _with_api(self, call: ApiCall[T]) -> T:
        async with self._opening:
            api = self._api
            if api is None:
                stack = AsyncExitStack()
                opened: Api = await stack.enter_async_context(kube_client(self.kubeconfig))
                self._api, self._stack, api = opened, stack, opened
        try:
            return await call(api)
        except BaseException:
            await self._drop()
            raise

    async def _drop(self) -> None:
        stack, self._stack, self._api = self._stack, None, None
        if stack is not None:
            try:
                await stack.aclose()
            except Exception as exc:  # closing a broken client must not hide the call's error
                log.debug("closing the API client failed", extra={"error": str(exc)})


def spawner_on(loop: asyncio.AbstractEventLoop, api: Api) -> Spawn:
    """``spawn`` for code whose agent already runs a loop and a client (the DRA agent)."""

    def spawn(call: ApiCall[Any]) -> concurrent.futures.Future[Any]:
        return asyncio.run_coroutine_threadsafe(_awaited(call(api)), loop)

    return spawn


async def _awaited(awaitable: Awaitable[T]) -> T:
    return await awaitable


__all__ = ["ApiCall", "ApiLoop", "Spawn", "spawner_on"]
