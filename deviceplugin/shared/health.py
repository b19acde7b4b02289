"""Card health from NVML: critical XID and double-bit ECC events, lost cards, and recovery.

One thread owns all NVML health calls. It waits on an NVML event set for at most
``wait_ms`` at a time, so an event reaches the allocator (and ListAndWatch) well within a second,
and between waits it probes every card (``nvmlDeviceGetHandleByUUID`` + memory info) every
``probe_interval_s``: a card that stops answering is Unhealthy, and an Unhealthy card that answers
again and has seen no critical event for ``quiet_s`` is Healthy again.

XIDs that applications cause (configurable; by default 13, 31, 43, 45, 68) leave the card alone.
No NVML error escapes this thread: it logs, drops its event set and builds a new one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import pynvml

from deviceplugin.shared.inventory import Card

log = logging.getLogger(__name__)

EVENT_XID = pynvml.nvmlEventTypeXidCriticalError
EVENT_DBE = pynvml.nvmlEventTypeDoubleBitEccError
WANTED_EVENTS = EVENT_XID | EVENT_DBE

HealthCallback = Callable[[int, bool, str], None]
EventCallback = Callable[[int, str], None]


@dataclass(slots=True)
class _CardState:
    card: Card
    healthy: bool = True
    last_bad: float = float("-inf")


class HealthMonitor:
    def __init__(
        self,
        cards: Iterable[Card],
        on_change: HealthCallback,
        *,
        ignored_xids: frozenset[int],
        wait_ms: int = 200,
        probe_interval_s: float = 5.0,
        quiet_s: float = 30.0,
        error_backoff_s: float = 1.0,
        on_event: EventCallback | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._cards = {c.index: _CardState(c) for c in cards}
        self._on_change = on_change
        self._on_event = on_event
        self.ignored_xids = ignored_xids
        self.wait_ms = wait_ms
        self.probe_interval_s = probe_interval_s
        self.quiet_s = quiet_s
        self.error_backoff_s = error_backoff_s
        self._clock = clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._event_set: Any = None
        self.errors = 0  # NVML errors survived (health and metrics read it)
        self.alive_at = clock()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="nvml-health", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._free_event_set()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ---- the loop ----------------------------------------------------------------------

    def _run(self) -> None:
        next_probe = self._clock()
        while not self._stop.is_set():
            self.alive_at = self._clock()
            try:
                if self._event_set is None:
                    self._event_set = self._create_event_set()
                self._wait_once()
            except pynvml.NVMLError as exc:
                self._nvml_error("event wait", exc)
            except Exception:  # a bug here must not silence health for good
                self.errors += 1
                log.exception("health loop failed; retrying")
                self._stop.wait(self.error_backoff_s)
            if self._clock() >= next_probe:
                self._probe_all()
                next_probe = self._clock() + self.probe_interval_s

    def _nvml_error(self, what: str, exc: Exception) -> None:
        self.errors += 1
        log.warning("NVML error; rebuilding the event set", extra={"op": what, "error": str(exc)})
        self._free_event_set()
        self._stop.wait(self.error_backoff_s)

    def _create_event_set(self) -> Any:
        event_set = pynvml.nvmlEventSetCreate()
        for state in self._cards.values():
            try:
                handle = pynvml.nvmlDeviceGetHandleByUUID(state.card.uuid)
                supported = int(pynvml.nvmlDeviceGetSupportedEventTypes(handle))
                wanted = supported & WANTED_EVENTS
                if wanted:
                    pynvml.nvmlDeviceRegisterEvents(handle, wanted, event_set)
                else:
                    log.warning("card reports no health events", extra={"card": state.card.index})
            except pynvml.NVMLError as exc:
                # A card that cannot even register is probed instead (and marked by the probe).
                self.errors += 1
                log.warning(
                    "cannot watch card events",
                    extra={"card": state.card.index, "error": str(exc)},
                )
        return event_set

    def _free_event_set(self) -> None:
        if self._event_set is None:
            return
        event_set, self._event_set = self._event_set, None
        try:
            pynvml.nvmlEventSetFree(event_set)
        except pynvml.NVMLError as exc:
            log.warning("NVML event set free failed", extra={"error": str(exc)})

    def _wait_once(self) -> None:
        try:
            data = pynvml.nvmlEventSetWait_v2(self._event_set, self.wait_ms)
        except pynvml.NVMLError_Timeout:
            return
        self.handle_event(self._card_of(data.device), int(data.eventType), int(data.eventData))

    def _card_of(self, device: Any) -> int | None:
        if not device:
            return None  # NVML reports some XIDs for no particular device
        try:
            return int(pynvml.nvmlDeviceGetIndex(device))
        except pynvml.NVMLError:
            return None

    # ---- decisions (public for tests of the policy) ------------------------------------

    def handle_event(self, card: int | None, event_type: int, data: int) -> None:
        if event_type & EVENT_XID:
            if data in self.ignored_xids:
                log.info("application XID ignored", extra={"card": card, "xid": data})
                self._event(card, f"xid-{data}-ignored")
                return
            reason = f"XID {data}"
        elif event_type & EVENT_DBE:
            reason = "double-bit ECC error"
        else:
            return
        targets = list(self._cards) if card is None or card not in self._cards else [card]
        for index in targets:
            state = self._cards[index]
            state.last_bad = self._clock()
            self._event(index, reason)
            self._set(state, False, reason)

    def _event(self, card: int | None, reason: str) -> None:
        if self._on_event is not None:
            self._on_event(-1 if card is None else card, reason)

    def _set(self, state: _CardState, healthy: bool, reason: str) -> None:
        if state.healthy == healthy:
            return
        state.healthy = healthy
        try:
            self._on_change(state.card.index, healthy, reason)
        except Exception:
            log.exception("health callback failed", extra={"card": state.card.index})

    def _probe_all(self) -> None:
        for state in self._cards.values():
            try:
                handle = pynvml.nvmlDeviceGetHandleByUUID(state.card.uuid)
                pynvml.nvmlDeviceGetMemoryInfo(handle)
            except pynvml.NVMLError as exc:
                self.errors += 1
                state.last_bad = self._clock()
                self._set(state, False, f"NVML: {exc}")
                continue
            if not state.healthy and self._clock() - state.last_bad >= self.quiet_s:
                self._set(state, True, "answers NVML and no critical event for the quiet period")
