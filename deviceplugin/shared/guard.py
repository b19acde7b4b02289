"""The node guard: the hard memory boundary outside the container.

The hook inside a container counts what the program allocates through the CUDA driver API; what
it cannot see (raw ioctls on the device nodes, a scribbled accounting region) still shows up in
the driver's own per-process accounting. This thread reads that accounting from NVML every
``interval_s``, attributes each process to its container, and acts when a container holds more
of a card than it was granted: it reports first (a log line, the metrics, and a Kubernetes Event
when a reporter for one is configured) and, after ``grace_s`` of continuous excess, kills the
container's processes on that card, largest first, until the rest fits.

From a pid to a fracgpu container, using only what the container cannot change:

1. ``<proc_root>/<pid>/cgroup``: the runtime put the process in its container's cgroup, and an
   unprivileged process cannot leave it (a cgroup namespace changes only its own view; this
   file is read in the plugin's view). The path holds the pod UID (``pod<uid>``; ``_`` for
   ``-`` under the systemd driver) and, one level below, the container ID
   (``cri-containerd-<id>.scope``, ``crio-<id>.scope``, ``docker-<id>.scope`` or a bare
   ``<id>`` under the cgroupfs driver). Anything deeper still belongs to that container.
2. ``<container_logs>/<pod>_<namespace>_<container>-<id>.log``: kubelet links every container's
   log there, whatever the runtime, to ``…/pods/<namespace>_<pod>_<uid>/<container>/<n>.log``.
   The link's target names the pod, its namespace and UID and the container; the UID must equal
   the cgroup's, so a pod deleted and created again under the same name is never confused.
3. kubelet's PodResources ``List`` (the agent's client): what the container holds, from which
   the agent names its *grant*, the directory whose limits file the hook enforces: in
   device-plugin mode the container's own (named after its device IDs), in DRA mode its claim's
   (a claim shared by several containers is one grant, one accounting region, and the guard
   adds up their processes as the hook does).

A process that fails any step (a system process, a container of another device plugin, a pod
that holds no fracgpu resource) belongs to no fracgpu container: it is counted, never acted on.
Resolutions are cached per container ID (a container's devices never change); a miss is retried
after ``miss_retry_s``, doubling up to a minute, so foreign GPU containers cost one PodResources
call a minute each.

A kill never reaches a pid that was reused: the process's start time (``stat`` field 22) must be
the one seen when it first showed the excess, a pidfd is opened, the start time and the cgroup
are read again through it, and only then is SIGKILL sent through the pidfd, which cannot name any
other process.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import pynvml
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from core.contract import Limits, LimitsError
from core.units import MIB
from deviceplugin.shared.flags import GuardSettings
from deviceplugin.shared.hostfiles import read_limits
from deviceplugin.shared.inventory import Card
from deviceplugin.shared.podresources import ContainerDevices, PodResourcesError
from deviceplugin.shared.sharing import PolicyOf, ShareMeter

log = logging.getLogger(__name__)

# kubelet's pod cgroup (``pod<uid>``, ``.slice`` under systemd), then the container's own cgroup.
_CGROUP = re.compile(
    r"/(?:[^/]*-)?pod([0-9a-f][0-9a-f_-]{31,35})(?:\.slice)?"
    r"/(?:(?:cri-containerd|crio|docker)-)?([0-9a-f]{64})(?:\.scope)?(?:/|$)"
)
# ``<namespace>_<pod>_<uid>/<container>/<n>.log`` under kubelet's pod log directory.
_LOG_TARGET = re.compile(r"([^/_]+)_([^/_]+)_([0-9a-f][0-9a-f-]{31,35})/([^/]+)/[^/]+$")
_MAX_MISS_RETRY_S = 60.0
_FORGET_AFTER_S = 300.0


class GuardMetrics:
    """The guard's metrics, under the prefix of the agent that runs it (its caller's registry)."""

    def __init__(self, registry: CollectorRegistry, prefix: str) -> None:
        self.registry = registry
        self.guard_excess = Counter(
            f"{prefix}_guard_excess",
            "Times a grant was found holding more of a card than it was given",
            ["card"],
            registry=registry,
        )
        self.guard_containers_over = Gauge(
            f"{prefix}_guard_containers_over_grant",
            "Grants (containers; claims in DRA mode) over their share of the card at the last scan",
            ["card"],
            registry=registry,
        )
        self.guard_kills = Counter(
            f"{prefix}_guard_kills",
            "Processes the guard killed for their grant's excess",
            ["card"],
            registry=registry,
        )
        self.guard_kills_skipped = Counter(
            f"{prefix}_guard_kills_skipped",
            "Kills not made, by reason (pid reused, gone, left the container, not permitted)",
            ["reason"],
            registry=registry,
        )
        self.guard_foreign_processes = Gauge(
            f"{prefix}_guard_foreign_processes",
            "Processes on the card that belong to no fracgpu container (never acted on)",
            ["card"],
            registry=registry,
        )
        self.guard_unmeasured_processes = Gauge(
            f"{prefix}_guard_unmeasured_processes",
            "Processes on the card for which NVML gives no memory figure",
            ["card"],
            registry=registry,
        )
        self.guard_nvml_errors = Counter(
            f"{prefix}_guard_nvml_errors",
            "Process-list reads NVML failed (no action on the card that pass)",
            ["card"],
            registry=registry,
        )
        # Each share's use against its grant, per card: the per-container figures that a
        # card-level exporter (dcgm-exporter) cannot give on a shared card. One series per
        # grant and card while the grant has processes on the card (bounded by the node's
        # containers), removed when it has none.
        share = ["namespace", "pod", "container", "card_uuid", "model"]
        self.share_memory_used = Gauge(
            f"{prefix}_share_memory_used_bytes",
            "Card memory the share's processes hold, as NVML counts it (CUDA contexts included)",
            share,
            registry=registry,
        )
        self.share_memory_granted = Gauge(
            f"{prefix}_share_memory_granted_bytes",
            "Card memory the share was granted (its limits file)",
            share,
            registry=registry,
        )
        self.share_compute_used = Gauge(
            f"{prefix}_share_compute_used_percent",
            "Percent of the card's SMs the share's processes kept busy since the previous scan "
            "(NVML's per-process utilisation samples; absent where the card does not sample)",
            share,
            registry=registry,
        )
        self.share_compute_granted = Gauge(
            f"{prefix}_share_compute_granted_percent",
            "Percent of the card's compute the share was granted (100: unthrottled)",
            share,
            registry=registry,
        )
        self.share_compute_ceiling = Gauge(
            f"{prefix}_share_compute_ceiling_percent",
            "Percent of the card's compute the share may use now: its grant, or more while "
            "idle compute is lent to it (the usage file its hook reads)",
            share,
            registry=registry,
        )
        self.usage_files_written = Counter(
            f"{prefix}_usage_files_written",
            "Usage files written for the shares' hooks (each share's own use and its ceiling)",
            registry=registry,
        )
        self.guard_scan_seconds = Histogram(
            f"{prefix}_guard_scan_seconds",
            "Time of one guard scan over every card",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1),
            registry=registry,
        )


@dataclass(frozen=True, slots=True)
class ContainerRef:
    """A container as its cgroup names it."""

    pod_uid: str
    container_id: str


def parse_cgroup(text: str) -> ContainerRef | None:
    """The pod UID and container ID in a ``/proc/<pid>/cgroup`` file (cgroup v1 or v2)."""
    for line in text.splitlines():
        _, _, path = line.partition(":")
        _, _, path = path.partition(":")
        match = _CGROUP.search(path)
        if match is not None:
            return ContainerRef(match.group(1).replace("_", "-"), match.group(2))
    return None


class ProcReader:
    """Reads processes under ``root`` (the node's /proc, with the host's PID namespace)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def container(self, pid: int) -> ContainerRef | None:
        try:
            text = (self.root / str(pid) / "cgroup").read_text()
        except (OSError, UnicodeDecodeError):
            return None  # gone, or not ours to read
        return parse_cgroup(text)

    def start_time(self, pid: int) -> int | None:
        """Field 22 of ``stat``: clock ticks after boot; with the pid, names one process."""
        try:
            text = (self.root / str(pid) / "stat").read_text()
        except (OSError, UnicodeDecodeError):
            return None
        # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
        fields = text.rpartition(")")[2].split()
        try:
            return int(fields[19])
        except (IndexError, ValueError):
            return None


@dataclass(frozen=True, slots=True)
class Owner:
    """A fracgpu container and its grant (``grant``: the grant's limits directory, its key)."""

    namespace: str
    pod: str
    container: str
    pod_uid: str
    container_id: str
    limits: Limits
    grant: str = ""

    @property
    def name(self) -> str:
        return f"{self.namespace}/{self.pod}/{self.container}"

    def allowed(self, card_uuid: str) -> int:
        """Bytes this container may hold on the card (0 on a card it was not given)."""
        return self.limits.memory_bytes if card_uuid in self.limits.devices else 0


class GrantError(RuntimeError):
    """No grant can be named for a listed container (no limits file yet, an unknown claim)."""


ListContainers = Callable[[], list[ContainerDevices]]
LimitsDir = Callable[[ContainerDevices], Path]
Grant = Callable[[ContainerDevices], tuple[str, Limits]]


def grant_from(limits_dir: LimitsDir) -> Grant:
    """A container's grant: the limits file the agent wrote before the container ran, in the
    directory ``limits_dir`` names for it (the agent's own layout; GrantError if none)."""

    def grant(container: ContainerDevices) -> tuple[str, Limits]:
        directory = limits_dir(container)
        try:
            return str(directory), read_limits(directory)
        except (OSError, UnicodeDecodeError, LimitsError) as exc:
            raise GrantError(f"container {container.name} has no limits file: {exc}") from None

    return grant


@dataclass(slots=True)
class _Miss:
    retry_at: float
    wait_s: float


class Owners:
    """From a cgroup's container to the fracgpu container that holds it, cached."""

    def __init__(
        self,
        container_logs: Path,
        list_containers: ListContainers,
        grant: Grant,
        *,
        miss_retry_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.container_logs = container_logs
        self._list = list_containers
        self._grant = grant
        self.miss_retry_s = miss_retry_s
        self._clock = clock
        self._known: dict[ContainerRef, tuple[Owner, float]] = {}
        self._misses: dict[ContainerRef, _Miss] = {}

    def resolve(self, ref: ContainerRef) -> Owner | None:
        now = self._clock()
        known = self._known.get(ref)
        if known is not None:
            self._known[ref] = (known[0], now)
            return known[0]
        miss = self._misses.get(ref)
        if miss is not None and now < miss.retry_at:
            return None
        owner = self._lookup(ref)
        if owner is None:
            wait = self.miss_retry_s if miss is None else min(miss.wait_s * 2, _MAX_MISS_RETRY_S)
            self._misses[ref] = _Miss(now + wait, wait)
            return None
        self._misses.pop(ref, None)
        self._known[ref] = (owner, now)
        return owner

    def forget_idle(self) -> None:
        """Drop what was not asked about for a while (containers end; the cache must not grow)."""
        horizon = self._clock() - _FORGET_AFTER_S
        for ref in [r for r, (_, seen) in self._known.items() if seen < horizon]:
            del self._known[ref]
        for ref in [r for r, m in self._misses.items() if m.retry_at < horizon]:
            del self._misses[ref]

    def _named(self, ref: ContainerRef) -> tuple[str, str, str] | None:
        """(namespace, pod, container) from kubelet's log link of this container."""
        try:
            links = list(self.container_logs.glob(f"*-{ref.container_id}.log"))
        except OSError:
            return None
        for link in links:
            try:
                target = os.readlink(link)
            except OSError:
                continue
            match = _LOG_TARGET.search(target)
            if match is not None and match.group(3) == ref.pod_uid:
                return match.group(1), match.group(2), match.group(4)
        return None

    def _lookup(self, ref: ContainerRef) -> Owner | None:
        named = self._named(ref)
        if named is None:
            return None
        namespace, pod, container = named
        try:
            listed = self._list()
        except PodResourcesError as exc:
            log.warning("guard cannot list pod resources", extra={"error": str(exc)})
            return None
        for entry in listed:
            if (entry.namespace, entry.pod, entry.container) != named:
                continue
            try:
                grant, limits = self._grant(entry)
            except GrantError as exc:
                log.warning(
                    "guard cannot compute a grant",
                    extra={"container": entry.name, "error": str(exc)},
                )
                return None
            return Owner(namespace, pod, container, ref.pod_uid, ref.container_id, limits, grant)
        return None


class Reporter(Protocol):
    """Where the guard's findings go besides its log and metrics (a Kubernetes Event sink)."""

    def excess(self, owner: Owner, card: Card, used: int, allowed: int, grace_s: float) -> None: ...

    def killed(self, owner: Owner, card: Card, pid: int, used: int, allowed: int) -> None: ...


@dataclass(frozen=True, slots=True)
class Process:
    pid: int
    used: int  # bytes
    start: int  # stat field 22
    ref: ContainerRef | None = None  # its container (a grant may span several)


@dataclass(slots=True)
class _Episode:
    """A grant over its share of one card, since ``since`` (monotonic)."""

    since: float
    starts: dict[int, int] = field(default_factory=dict)  # pid -> start time first seen


@dataclass(frozen=True, slots=True)
class Usage:
    owner: Owner
    card: Card
    processes: tuple[Process, ...]

    @property
    def used(self) -> int:
        return sum(p.used for p in self.processes)


@dataclass(slots=True)
class Observation:
    """One scan's reading: each grant's processes per card (``owner``: the first container of
    the grant seen; its name is what logs and Events point at)."""

    usage: list[Usage] = field(default_factory=list)
    foreign: dict[int, int] = field(default_factory=dict)  # card -> processes of no container
    unmeasured: dict[int, int] = field(default_factory=dict)  # card -> no per-process figure
    failed: set[int] = field(default_factory=set)  # cards whose lists NVML did not give
    # card -> pid -> percent of the card's SMs busy with it since the previous scan; a card
    # whose utilisation NVML does not sample (MIG, some models) is not here.
    busy: dict[int, dict[int, float]] = field(default_factory=dict)


def card_processes(card: Card, handle: Any = None) -> dict[int, int | None]:
    """pid -> bytes (None: NVML cannot tell) on one card, compute and graphics lists together.

    A process in both lists (a graphics context that also computes) appears with the same
    figure in each; it is counted once. ``handle``: the card's, when the caller has it.
    """
    if handle is None:
        handle = pynvml.nvmlDeviceGetHandleByUUID(card.uuid)
    merged: dict[int, int | None] = {}
    for info in (
        *pynvml.nvmlDeviceGetComputeRunningProcesses(handle),
        *pynvml.nvmlDeviceGetGraphicsRunningProcesses(handle),
    ):
        pid = int(info.pid)
        used = None if info.usedGpuMemory is None else int(info.usedGpuMemory)
        if pid in merged and (used is None or (merged[pid] or 0) >= used):
            continue
        merged[pid] = used
    return merged


class Utilisation:
    """Each process's share of a card's SMs, from NVML's per-process samples.

    The driver keeps a few seconds of samples per card (one every ~1/6 s per active process);
    asking for those newer than the last one seen gives each scan the samples of its own
    interval, and a process's figure is the mean of its samples there. No sample for a process
    means it did not use the SMs (NVML answers NOT_FOUND when no process did).
    """

    def __init__(self) -> None:
        self._seen: dict[str, int] = {}  # card UUID -> newest sample timestamp (µs)
        self._unsampled: set[str] = set()  # cards whose driver does not sample

    def read(self, card: Card, handle: Any) -> dict[int, float] | None:
        """pid -> percent busy since the previous read (None: this card is not sampled)."""
        if card.uuid in self._unsampled:
            return None
        try:
            samples = pynvml.nvmlDeviceGetProcessUtilization(handle, self._seen.get(card.uuid, 0))
        except pynvml.NVMLError_NotFound:
            return {}
        except pynvml.NVMLError_NotSupported:
            self._unsampled.add(card.uuid)
            log.info("card does not sample per-process utilisation", extra={"card": card.uuid})
            return None
        sums: dict[int, list[float]] = {}
        for sample in samples:
            sums.setdefault(int(sample.pid), []).append(float(sample.smUtil))
            self._seen[card.uuid] = max(self._seen.get(card.uuid, 0), int(sample.timeStamp))
        return {pid: sum(values) / len(values) for pid, values in sums.items()}


def kill_verified(proc: ProcReader, pid: int, start: int, ref: ContainerRef) -> str:
    """SIGKILL ``pid`` only if it is still the process seen (start time, container); the outcome.

    The pidfd is opened first: once the checks pass through it, the signal can reach no other
    process, even if this one exits and its pid is reused in between.
    """
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return "gone"
    try:
        if proc.start_time(pid) != start:
            return "pid reused"
        if proc.container(pid) != ref:
            return "left the container"
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        return "killed"
    except ProcessLookupError:
        return "gone"
    except PermissionError:
        return "not permitted"  # the plugin lacks CAP_KILL for this process's user
    finally:
        os.close(pidfd)


class Guard:
    def __init__(
        self,
        cards: Iterable[Card],
        owners: Owners,
        proc: ProcReader,
        metrics: GuardMetrics,
        *,
        interval_s: float = 0.5,
        grace_s: float = 1.0,
        kill: bool = True,
        process_overhead_mib: int = 512,
        reporter: Reporter | None = None,
        meter: ShareMeter | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cards = {c.index: c for c in cards}
        self.meter = meter
        self.owners = owners
        self.proc = proc
        self.metrics = metrics
        self.interval_s = interval_s
        self.grace_s = grace_s
        self.kill = kill
        self.overhead = process_overhead_mib * MIB
        self.reporter = reporter
        self._clock = clock
        self._episodes: dict[tuple[str, int], _Episode] = {}
        self._exported: set[tuple[str, ...]] = set()  # share series set at the last scan
        self._failing: dict[int, str] = {}  # card -> the NVML error already logged
        self.utilisation = Utilisation()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- the thread --------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="guard", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                with self.metrics.guard_scan_seconds.time():
                    self.scan_once()
            except Exception:  # a bug here must not end the boundary for good
                log.exception("guard scan failed")

    # ---- one pass (public for tests and the benchmark) ---------------------------------

    def scan_once(self) -> Observation:
        observation = self.observe()
        self.act(observation)
        self.owners.forget_idle()
        return observation

    def observe(self) -> Observation:
        observation = Observation()
        grouped: dict[tuple[str, int], list[Process]] = {}
        owners: dict[str, Owner] = {}
        for index, card in sorted(self.cards.items()):
            try:
                handle = pynvml.nvmlDeviceGetHandleByUUID(card.uuid)
                processes = card_processes(card, handle)
            except pynvml.NVMLError as exc:
                self._nvml_failed(card, exc)
                observation.failed.add(index)
                continue
            if self._failing.pop(index, None) is not None:
                log.info("guard reads the card's processes again", extra={"card": index})
            foreign = unmeasured = 0
            for pid, used in processes.items():
                if used is None:
                    unmeasured += 1
                    continue
                ref = self.proc.container(pid)
                owner = None if ref is None else self.owners.resolve(ref)
                start = self.proc.start_time(pid)
                if ref is None or owner is None or start is None:
                    foreign += 1
                    continue
                key = owner.grant or owner.name
                owners.setdefault(key, owner)
                grouped.setdefault((key, index), []).append(Process(pid, used, start, ref))
            try:
                busy = self.utilisation.read(card, handle)
            except pynvml.NVMLError as exc:  # the figure is for metrics only: never fatal
                log.debug("per-process utilisation unreadable", extra={"error": str(exc)})
                busy = None
            if busy is not None:
                observation.busy[index] = busy
            observation.foreign[index] = foreign
            observation.unmeasured[index] = unmeasured
            self.metrics.guard_foreign_processes.labels(str(index)).set(foreign)
            self.metrics.guard_unmeasured_processes.labels(str(index)).set(unmeasured)
        observation.usage = [
            Usage(owners[key], self.cards[index], tuple(processes))
            for (key, index), processes in grouped.items()
        ]
        given: dict[str, int] = {}
        if self.meter is not None:
            written = self.meter.written
            given = self.meter.update(observation.usage, observation.busy)
            self.metrics.usage_files_written.inc(self.meter.written - written)
        self._export(observation.usage, observation.busy, given)
        return observation

    def _export(
        self,
        usage: list[Usage],
        busy: dict[int, dict[int, float]],
        ceilings: Mapping[str, int] | None = None,
    ) -> None:
        """Each share's use and grant per card; series of shares no longer seen are removed."""
        now: dict[tuple[str, ...], tuple[int, Usage]] = {}
        compute: dict[tuple[str, ...], float] = {}
        for entry in usage:
            owner, card = entry.owner, entry.card
            labels: tuple[str, ...] = (
                owner.namespace,
                owner.pod,
                owner.container,
                card.uuid,
                card.product,
            )
            held = now.get(labels)
            now[labels] = (entry.used + (held[0] if held else 0), entry)
            card_busy = busy.get(card.index)
            if card_busy is not None:
                share = sum(card_busy.get(p.pid, 0.0) for p in entry.processes)
                compute[labels] = compute.get(labels, 0.0) + share
        metrics = self.metrics
        for labels, (used, entry) in now.items():
            metrics.share_memory_used.labels(*labels).set(used)
            if labels in compute:
                metrics.share_compute_used.labels(*labels).set(min(100.0, compute[labels]))
            else:
                with suppress(KeyError):
                    metrics.share_compute_used.remove(*labels)
            metrics.share_memory_granted.labels(*labels).set(entry.owner.allowed(entry.card.uuid))
            metrics.share_compute_granted.labels(*labels).set(entry.owner.limits.compute_percent)
            ceiling = (ceilings or {}).get(entry.owner.grant)
            if ceiling is not None:
                metrics.share_compute_ceiling.labels(*labels).set(ceiling)
            else:
                with suppress(KeyError):
                    metrics.share_compute_ceiling.remove(*labels)
        for labels in self._exported - now.keys():
            for gauge in (
                metrics.share_memory_used,
                metrics.share_memory_granted,
                metrics.share_compute_used,
                metrics.share_compute_granted,
                metrics.share_compute_ceiling,
            ):
                with suppress(KeyError):
                    gauge.remove(*labels)
        self._exported = set(now)

    def _nvml_failed(self, card: Card, exc: Exception) -> None:
        self.metrics.guard_nvml_errors.labels(str(card.index)).inc()
        if self._failing.get(card.index) != str(exc):
            self._failing[card.index] = str(exc)
            log.warning(
                "guard cannot read the card's processes from NVML; no action on this card "
                "until it can",
                extra={"card": card.index, "error": str(exc)},
            )

    def allowed(self, usage: Usage) -> int:
        """The grant plus each process's CUDA context, which NVML counts and the hook does not."""
        return usage.owner.allowed(usage.card.uuid) + self.overhead * len(usage.processes)

    def act(self, observation: Observation) -> None:
        now = self._clock()
        over: set[tuple[str, int]] = set()
        for usage in observation.usage:
            key = (usage.owner.grant or usage.owner.name, usage.card.index)
            allowed = self.allowed(usage)
            if usage.used <= allowed:
                continue
            over.add(key)
            episode = self._episodes.get(key)
            if episode is None:
                episode = self._episodes[key] = _Episode(now)
                self._report_excess(usage, allowed)
            fresh = self._note_starts(episode, usage)
            if self.kill and now - episode.since >= self.grace_s:
                self._kill(usage, allowed, fresh)
        # Episodes of cards that could not be read this time are kept: no news is not a cure.
        for key in list(self._episodes):
            if key not in over and key[1] not in observation.failed:
                del self._episodes[key]
                log.info("grant is back within its share", extra={"grant": key[0], "card": key[1]})
        counts: dict[int, int] = dict.fromkeys(self.cards, 0)
        for _, card in self._episodes:
            counts[card] += 1
        for card, count in counts.items():
            self.metrics.guard_containers_over.labels(str(card)).set(count)

    def _note_starts(self, episode: _Episode, usage: Usage) -> set[int]:
        """Record each process's start time; the pids seen before with the same one."""
        settled = set()
        for process in usage.processes:
            first = episode.starts.setdefault(process.pid, process.start)
            if first == process.start:
                settled.add(process.pid)
            else:
                self.metrics.guard_kills_skipped.labels("pid reused").inc()
                log.warning(
                    "guard saw a pid reused during an excess; not killing it this pass",
                    extra={"pid": process.pid, "container": usage.owner.name},
                )
                episode.starts[process.pid] = process.start
        return settled

    def _report_excess(self, usage: Usage, allowed: int) -> None:
        card = usage.card
        self.metrics.guard_excess.labels(str(card.index)).inc()
        log.warning(
            "container holds more card memory than its grant",
            extra={
                "container": usage.owner.name,
                "pod_uid": usage.owner.pod_uid,
                "card": card.index,
                "used_bytes": usage.used,
                "allowed_bytes": allowed,
                "pids": [p.pid for p in usage.processes],
                "kill_after_s": self.grace_s if self.kill else None,
            },
        )
        if self.reporter is not None:
            self.reporter.excess(usage.owner, card, usage.used, allowed, self.grace_s)

    def _kill(self, usage: Usage, allowed: int, settled: set[int]) -> None:
        """Kill the largest processes until the rest fits (the rest keep their contexts).

        When the next in line cannot be killed now (its pid was reused, it left the container)
        the pass stops: killing smaller processes in its place would take more than needed,
        and the next scan sees the container as it is then.
        """
        remaining = usage.used
        for process in sorted(usage.processes, key=lambda p: (-p.used, p.pid)):
            if remaining <= allowed:
                break
            if process.pid not in settled:
                break
            ref = process.ref or ContainerRef(usage.owner.pod_uid, usage.owner.container_id)
            outcome = kill_verified(self.proc, process.pid, process.start, ref)
            if outcome not in ("killed", "gone"):
                self.metrics.guard_kills_skipped.labels(outcome).inc()
                log.info(
                    "guard did not kill",
                    extra={"pid": process.pid, "container": usage.owner.name, "why": outcome},
                )
                break
            remaining -= process.used
            allowed -= self.overhead  # its context is gone with it
            if outcome == "gone":  # it ended by itself
                self.metrics.guard_kills_skipped.labels(outcome).inc()
                continue
            self.metrics.guard_kills.labels(str(usage.card.index)).inc()
            log.warning(
                "guard killed a process over its container's grant",
                extra={
                    "container": usage.owner.name,
                    "pod_uid": usage.owner.pod_uid,
                    "card": usage.card.index,
                    "pid": process.pid,
                    "used_bytes": process.used,
                    "container_used_bytes": usage.used,
                    "allowed_bytes": allowed,
                },
            )
            if self.reporter is not None:
                self.reporter.killed(usage.owner, usage.card, process.pid, process.used, allowed)


def build_guard(
    settings: GuardSettings,
    *,
    cards: Iterable[Card],
    list_containers: ListContainers,
    limits_dir: LimitsDir,
    metrics: GuardMetrics,
    reporter: Reporter | None,
    policy_of: PolicyOf | None = None,
) -> Guard:
    """The guard as either agent runs it: ``list_containers`` and ``limits_dir`` are the agent's
    view of who holds what and where its grants live."""
    owners = Owners(settings.container_logs, list_containers, grant_from(limits_dir))
    return Guard(
        cards,
        owners,
        ProcReader(settings.proc_root),
        metrics,
        interval_s=settings.interval_s,
        grace_s=settings.grace_s,
        kill=settings.kill,
        process_overhead_mib=settings.process_overhead_mib,
        reporter=reporter,
        meter=ShareMeter(policy_of),
    )


__all__ = [
    "ContainerRef",
    "GrantError",
    "Guard",
    "GuardMetrics",
    "Observation",
    "Owner",
    "Owners",
    "ProcReader",
    "Reporter",
    "build_guard",
    "card_processes",
    "grant_from",
    "kill_verified",
    "parse_cgroup",
]
