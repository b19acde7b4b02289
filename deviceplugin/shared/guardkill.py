"""The node guard's enforcement: when a grant holds more of a card than it was given, for how
long, and which of its processes are killed, and how, so that no other process is.

An excess is reported when first seen (guardreport.py); after ``grace_s`` of continuous excess
the grant's processes on that card are killed, largest first, until the rest fits. A scan that
could not read a card ends no excess on it: no news is not a cure.

A kill never reaches a pid that was reused: the process's start time (``stat`` field 22) must be
the one seen when it first showed the excess, a pidfd is opened, the start time and the cgroup
are read again through it, and only then is SIGKILL sent through the pidfd, which cannot name any
other process.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from deviceplugin.shared.guardproc import ProcReader
from deviceplugin.shared.guardreport import GuardReport
from deviceplugin.shared.guardtypes import ContainerRef, Observation, Usage

KillProcess = Callable[[ProcReader, int, int, ContainerRef], str]


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


@dataclass(slots=True)
class _Episode:
    """A grant over its share of one card, since ``since`` (monotonic)."""

    since: float
    starts: dict[int, int] = field(default_factory=dict)  # pid -> start time first seen


class Enforcer:
    """Holds each grant to its share of each card, from one scan's observation to the next.

    ``kill_process``: how one process is killed once chosen (``kill_verified``; tests give
    another to drive the choice without real processes).
    """

    def __init__(
        self,
        cards: Iterable[int],
        proc: ProcReader,
        report: GuardReport,
        *,
        grace_s: float = 1.0,
        kill: bool = True,
        overhead: int = 0,
        clock: Callable[[], float] = time.monotonic,
        kill_process: KillProcess = kill_verified,
    ) -> None:
        self.cards = list(cards)
        self.proc = proc
        self.report = report
        self.grace_s = grace_s
        self.kill = kill
        self.overhead = overhead  # bytes per process: its CUDA context
        self._clock = clock
        self._kill_process = kill_process
        self._episodes: dict[tuple[str, int], _Episode] = {}

    def allowed(self, usage: Usage) -> int:
        """The grant plus each process's CUDA context, which NVML counts and the hook does not."""
        return usage.owner.allowed(usage.card.uuid) + self.overhead * len(usage.processes)

    @property
    def over(self) -> set[tuple[str, int]]:
        """(grant, card) of each excess under way."""
        return set(self._episodes)

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
                self.report.excess(usage, allowed, grace_s=self.grace_s, kill=self.kill)
            fresh = self._note_starts(episode, usage)
            if self.kill and now - episode.since >= self.grace_s:
                self._kill(usage, allowed, fresh)
        # Episodes of cards that could not be read this time are kept: no news is not a cure.
        for key in list(self._episodes):
            if key not in over and key[1] not in observation.failed:
                del self._episodes[key]
                self.report.within(key[0], key[1])
        counts: dict[int, int] = dict.fromkeys(self.cards, 0)
        for _, card in self._episodes:
            counts[card] += 1
        self.report.over(counts)

    def _note_starts(self, episode: _Episode, usage: Usage) -> set[int]:
        """Record each process's start time; the pids seen before with the same one."""
        settled = set()
        for process in usage.processes:
            first = episode.starts.setdefault(process.pid, process.start)
            if first == process.start:
                settled.add(process.pid)
            else:
                self.report.pid_reused(usage, process.pid)
                episode.starts[process.pid] = process.start
        return settled

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
            outcome = self._kill_process(self.proc, process.pid, process.start, ref)
            if outcome not in ("killed", "gone"):
                self.report.not_killed(usage, process.pid, outcome)
                break
            remaining -= process.used
            allowed -= self.overhead  # its context is gone with it
            if outcome == "gone":  # it ended by itself
                self.report.gone()
                continue
            self.report.killed(usage, process, allowed)


__all__ = ["Enforcer", "KillProcess", "kill_verified"]
