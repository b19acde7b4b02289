"""A stand-in for the node agent's usage loop, for tests and benchmarks on the shared fake card.

Every period it reads the fake card's utilisation samples and its per-process samples (through
the uninstrumented copy of the fake NVML the kit builds, with ctypes), sums each share's
processes into the share's own use over the windows that closed since the last period, asks the
lending policy (deviceplugin/shared/lending.py) for the ceilings and writes each share's
``usage`` file. It also keeps what it measured, window by window, so a test reads each share's
use off the fake card's clock rather than off the wall clock of a loaded machine.

What the real agent will do is the same, with host PIDs mapped to shares by the node's guard; it
is not written yet.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from core.contract import USAGE_MAX_WINDOW_US, ShareUsage
from core.policy import Priority
from deviceplugin.shared.lending import ShareState, ceilings, wants_more
from testkit.native_kit import Kit

NVML_SUCCESS = 0
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_INSUFFICIENT_SIZE = 7
NVML_GPU_UTILIZATION_SAMPLES = 1


class _Sample(ctypes.Structure):
    _fields_ = [("timeStamp", ctypes.c_ulonglong), ("value", ctypes.c_ulonglong)]


class _ProcessSample(ctypes.Structure):
    _fields_ = [
        ("pid", ctypes.c_uint),
        ("timeStamp", ctypes.c_ulonglong),
        ("smUtil", ctypes.c_uint),
        ("memUtil", ctypes.c_uint),
        ("encUtil", ctypes.c_uint),
        ("decUtil", ctypes.c_uint),
    ]


class FakeCardNvml:
    """The fake NVML of the kit's shared card, loaded into this process."""

    def __init__(self, kit: Kit) -> None:
        # The fake driver reads this once, at its first cuInit in this process.
        os.environ["FAKE_CUDA_SHARED_CARD"] = str(kit.shared_card)
        self.lib = ctypes.CDLL(str(kit.build / "fake" / "plain" / "libnvidia-ml.so.1"))
        if self.lib.nvmlInit_v2() != NVML_SUCCESS:
            raise RuntimeError("fake nvmlInit_v2 failed")
        self.handle = ctypes.c_void_p()
        if self.lib.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(self.handle)) != NVML_SUCCESS:
            raise RuntimeError("fake nvmlDeviceGetHandleByIndex_v2 failed")

    def card_stamps(self, after_us: int) -> list[int]:
        """The stamps (µs) of the card's sample windows that closed after after_us."""
        buf = (_Sample * 128)()
        count = ctypes.c_uint(128)
        kind = ctypes.c_int()
        rc = self.lib.nvmlDeviceGetSamples(
            self.handle,
            NVML_GPU_UTILIZATION_SAMPLES,
            ctypes.c_ulonglong(after_us),
            ctypes.byref(kind),
            ctypes.byref(count),
            buf,
        )
        if rc == NVML_ERROR_NOT_FOUND:
            return []
        if rc != NVML_SUCCESS:
            raise RuntimeError(f"fake nvmlDeviceGetSamples: {rc}")
        return [int(buf[i].timeStamp) for i in range(count.value)]

    def process_samples(self, after_us: int) -> list[tuple[int, int, int]]:
        """(pid, window stamp µs, SM percent) of each process busy in each window after after_us,
        by NVML's sizing protocol: ask the count, then fetch."""
        count = ctypes.c_uint(0)
        fn = self.lib.nvmlDeviceGetProcessUtilization
        rc = fn(self.handle, None, ctypes.byref(count), ctypes.c_ulonglong(after_us))
        if rc == NVML_ERROR_NOT_FOUND:
            return []
        if rc != NVML_ERROR_INSUFFICIENT_SIZE:
            raise RuntimeError(f"fake nvmlDeviceGetProcessUtilization (size): {rc}")
        buf = (_ProcessSample * (count.value + 16))()
        count = ctypes.c_uint(count.value + 16)
        rc = fn(self.handle, buf, ctypes.byref(count), ctypes.c_ulonglong(after_us))
        if rc == NVML_ERROR_NOT_FOUND:
            return []
        if rc != NVML_SUCCESS:
            raise RuntimeError(f"fake nvmlDeviceGetProcessUtilization: {rc}")
        return [(int(s.pid), int(s.timeStamp), int(s.smUtil)) for s in buf[: count.value]]


class RealCardNvml:
    """A real card's NVML through pynvml, with the stand-in agent's two reads (the GPU tests)."""

    def __init__(self, index: int = 0) -> None:
        import pynvml

        self._nvml = pynvml
        pynvml.nvmlInit()
        self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)

    def card_stamps(self, after_us: int) -> list[int]:
        nvml = self._nvml
        try:
            _, samples = nvml.nvmlDeviceGetSamples(
                self._handle, nvml.NVML_GPU_UTILIZATION_SAMPLES, after_us
            )
        except nvml.NVMLError_NotFound:
            return []
        return sorted(int(s.timeStamp) for s in samples if int(s.timeStamp) > after_us)

    def process_samples(self, after_us: int) -> list[tuple[int, int, int]]:
        nvml = self._nvml
        try:
            samples = nvml.nvmlDeviceGetProcessUtilization(self._handle, after_us)
        except nvml.NVMLError_NotFound:
            return []
        return [
            (int(s.pid), int(s.timeStamp), int(s.smUtil))
            for s in samples
            if int(s.timeStamp) > after_us
        ]


@functools.cache
def fake_card_nvml(kit: Kit) -> FakeCardNvml:
    """One per process: the fake driver attaches to its shared card once."""
    return FakeCardNvml(kit)


@dataclass
class AgentShare:
    """One share the stand-in serves: its usage file's directory and its request."""

    name: str
    limits_dir: Path
    guarantee: int
    priority: Priority = Priority.LOW
    may_burst: bool = True
    pids: set[int] = field(default_factory=set)
    ceiling: int = 0  # the last one written; 0 before the first


@dataclass(frozen=True)
class Window:
    """What the stand-in measured over the card windows closed between two of its periods."""

    from_us: int
    to_us: int
    used: dict[str, float]  # share name -> its own SM use, percent
    ceiling: dict[str, int]


class ShareAgent:
    """The loop, on a thread: start(), then stop() returns; windows holds what it measured."""

    def __init__(
        self,
        nvml: FakeCardNvml | RealCardNvml,
        shares: list[AgentShare],
        period_s: float = 0.1,
        *,
        write: bool = True,
        clock_us: Callable[[], int] = lambda: time.time_ns() // 1000,
        per_process_mean: bool = False,
    ) -> None:
        self.nvml = nvml
        # The node agent's own reading (deviceplugin/shared/guard.py, Utilisation): each
        # process's mean over its samples since the last read, summed per share. The default,
        # the sum over the card's sample windows, fits the fake card's one sample per window.
        self.per_process_mean = per_process_mean
        self.raw: list[tuple[int, dict[int, list[int]]]] = []  # card windows, pid -> samples
        self.shares = shares
        self.period_s = period_s
        self.write = write
        self.write_until_us: int | None = None  # after this, measure only: an agent that died
        self.windows: list[Window] = []
        self._clock_us = clock_us
        self._seen_us = clock_us()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="share-agent", daemon=True)
        self.errors: list[BaseException] = []

    def start(self) -> ShareAgent:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        if self.errors:
            raise self.errors[0]

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.period_s):
                self.tick()
        except BaseException as exc:  # handed to the caller by stop()
            self.errors.append(exc)

    def tick(self) -> None:
        stamps = self.nvml.card_stamps(self._seen_us)
        if not stamps:
            return
        newest = stamps[-1]
        per_pid: dict[int, int] = {}
        samples: dict[int, list[int]] = {}
        for pid, _stamp, sm in self.nvml.process_samples(self._seen_us):
            per_pid[pid] = per_pid.get(pid, 0) + sm
            samples.setdefault(pid, []).append(sm)
        self.raw.append((len(stamps), samples))
        if self.per_process_mean:
            mean = {pid: sum(v) / len(v) for pid, v in samples.items()}
            used = {s.name: min(100.0, sum(mean.get(p, 0) for p in s.pids)) for s in self.shares}
        else:
            # Mean over the card's windows: a window where a share ran nothing counts as 0.
            used = {
                s.name: min(100.0, sum(per_pid.get(p, 0) for p in s.pids) / len(stamps))
                for s in self.shares
            }
        states = [
            ShareState(
                s.name,
                s.guarantee,
                s.priority,
                s.may_burst,
                used[s.name],
                wants_more(used[s.name], s.ceiling or s.guarantee, s.guarantee),
            )
            for s in self.shares
        ]
        given = ceilings(states)
        window_us = min(newest - self._seen_us, USAGE_MAX_WINDOW_US)
        for s in self.shares:
            s.ceiling = int(given[s.name])
            if self.write and (self.write_until_us is None or newest <= self.write_until_us):
                ShareUsage(newest, window_us, round(used[s.name]), s.ceiling).write_atomic(
                    s.limits_dir
                )
        self.windows.append(
            Window(self._seen_us, newest, used, {s.name: s.ceiling for s in self.shares})
        )
        self._seen_us = newest

    def mean_use(self, name: str, from_us: int, to_us: int) -> float:
        """A share's mean use over the windows wholly inside [from_us, to_us], time-weighted."""
        inside = [w for w in self.windows if w.from_us >= from_us and w.to_us <= to_us]
        total = sum(w.to_us - w.from_us for w in inside)
        if total == 0:
            raise AssertionError(f"no window measured in [{from_us}, {to_us}]")
        return sum(w.used[name] * (w.to_us - w.from_us) for w in inside) / total
