"""The early verifier: each new allocation checked against kubelet's PodResources before
kubelet asks for PreStartContainer.

kubelet calls PreStartContainer well after admission (after the pod sandbox exists), so the
List it needs can usually be done in between; PreStartContainer then only checks the limits
file. When the verifier has not finished, PreStartContainer lists by itself.

One thread; it waits on an Event, never in a sleep, so a stop ends it wherever it waits and it
logs nothing after its owner has gone.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from deviceplugin.classic.allocation import Allocation
from deviceplugin.classic.prestart import PreStartError
from deviceplugin.shared.podresources import PodResourcesError

log = logging.getLogger(__name__)


class EarlyVerifier:
    """``verify_one(allocation)`` is True once PodResources lists the allocation's container;
    the first look waits ``delay_s``, then up to ``retries`` looks, ``spacing_s`` apart,
    doubled after each miss."""

    def __init__(
        self,
        verify_one: Callable[[Allocation], bool],
        *,
        delay_s: float,
        retries: int,
        spacing_s: float,
        stop_within_s: float,
    ) -> None:
        self.verify_one = verify_one
        self.delay_s = delay_s
        self.retries = retries
        self.spacing_s = spacing_s
        self.stop_within_s = stop_within_s  # a PodResources call in flight: its own timeout
        self._queue: queue.Queue[tuple[Allocation, float] | None] = queue.Queue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None

    def submit(self, allocation: Allocation) -> None:
        self._queue.put((allocation, time.monotonic() + self.delay_s))

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="verify", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Returns once the thread has ended; only a PodResources call in flight can hold it,
        and a warning says so."""
        if self._thread is not None:
            self._stop.set()
            self._queue.put(None)
            self._thread.join(timeout=self.stop_within_s)
            if self._thread.is_alive():
                log.warning("the verifier outlived its stop (a PodResources call in flight)")
            self._thread = None

    def _run(self) -> None:
        stop = self._stop
        while (item := self._queue.get()) is not None:
            allocation, due = item
            if stop.wait(max(0.0, due - time.monotonic())):
                return
            for attempt in range(self.retries):
                if attempt and stop.wait(self.spacing_s * 2 ** (attempt - 1)):
                    return
                if allocation.verified:
                    break  # PreStartContainer came first and listed it itself
                try:
                    if self.verify_one(allocation):
                        break
                except (PodResourcesError, PreStartError, OSError) as exc:
                    log.info("early verification skipped", extra={"error": str(exc)})
                    break
                except Exception:  # a bug here must not stop verifying later containers
                    log.exception("early verification failed")
                    break
