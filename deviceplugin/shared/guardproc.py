"""What the node's /proc says about a pid that its process cannot change: its container and its
start time.

``<proc_root>/<pid>/cgroup``: the runtime put the process in its container's cgroup, and an
unprivileged process cannot leave it (a cgroup namespace changes only its own view; this file is
read in the plugin's view). The path holds the pod UID (``pod<uid>``; ``_`` for ``-`` under the
systemd driver) and, one level below, the container ID (``cri-containerd-<id>.scope``,
``crio-<id>.scope``, ``docker-<id>.scope`` or a bare ``<id>`` under the cgroupfs driver).
Anything deeper still belongs to that container.

``<proc_root>/<pid>/stat`` field 22, the start time: with the pid it names one process, so a pid
reused by another process is told apart from the one seen before.
"""

from __future__ import annotations

import re
from pathlib import Path

from deviceplugin.shared.guardtypes import ContainerRef

# kubelet's pod cgroup (``pod<uid>``, ``.slice`` under systemd), then the container's own cgroup.
_CGROUP = re.compile(
    r"/(?:[^/]*-)?pod([0-9a-f][0-9a-f_-]{31,35})(?:\.slice)?"
    r"/(?:(?:cri-containerd|crio|docker)-)?([0-9a-f]{64})(?:\.scope)?(?:/|$)"
)


def parse_cgroup(text: str) -> ContainerRef | None:
    """The pod UID and container ID in a ``/proc/<pid>/cgroup`` file (cgroup v1 or v2)."""
    for line in text.splitlines():
        _, _, path = line.partition(":")
        _, _, path = path.partition(":")
        match = _CGROUP.search(path)
        if match is not None:
            return ContainerRef(match.group(1).replace("_", "-"), match.group(2))
    return None


def parse_start_time(text: str) -> int | None:
    """Field 22 of a ``/proc/<pid>/stat`` file: clock ticks after boot."""
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    fields = text.rpartition(")")[2].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
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
        return parse_start_time(text)


__all__ = ["ProcReader", "parse_cgroup", "parse_start_time"]
