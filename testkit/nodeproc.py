"""What the node guard reads about a process, laid out as on a node, for real processes.

A test spawns real processes (``sleep``) and places them in fake containers: ``proc/<pid>/cgroup``
names the container's kubelet cgroup (systemd driver, containerd), ``proc/<pid>/stat`` links to
the process's real ``/proc/<pid>/stat`` (so its start time is real), and ``logs/`` holds
kubelet's container log links. ``reuse`` replaces a pid's ``stat`` with another start time, as
if the pid now named a different process.
"""

from __future__ import annotations

import hashlib
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class FakeContainer:
    namespace: str
    pod: str
    container: str
    pod_uid: str
    container_id: str

    def cgroup(self) -> str:
        slice_uid = self.pod_uid.replace("-", "_")
        return (
            "0::/kubepods.slice/kubepods-burstable.slice/"
            f"kubepods-burstable-pod{slice_uid}.slice/cri-containerd-{self.container_id}.scope\n"
        )


def container(namespace: str, pod: str, name: str) -> FakeContainer:
    seed = f"{namespace}/{pod}/{name}"
    return FakeContainer(
        namespace,
        pod,
        name,
        str(uuid.uuid5(uuid.NAMESPACE_URL, f"{namespace}/{pod}")),
        hashlib.sha256(seed.encode()).hexdigest(),
    )


class NodeProc:
    def __init__(self, root: Path) -> None:
        self.proc = root / "proc"
        self.logs = root / "logs"
        self.proc.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(parents=True, exist_ok=True)
        self.children: list[subprocess.Popen[bytes]] = []

    def spawn(self) -> subprocess.Popen[bytes]:
        child = subprocess.Popen(["sleep", "300"])
        self.children.append(child)
        return child

    def place(self, pid: int, cgroup: str) -> None:
        """Put ``pid`` in a cgroup (any text, as the kernel would show it)."""
        directory = self.proc / str(pid)
        directory.mkdir(exist_ok=True)
        (directory / "cgroup").write_text(cgroup)
        stat = directory / "stat"
        stat.unlink(missing_ok=True)
        stat.symlink_to(f"/proc/{pid}/stat")

    def enter(self, pid: int, target: FakeContainer) -> None:
        self.place(pid, target.cgroup())
        self.log_link(target)

    def log_link(self, target: FakeContainer, *, pod_uid: str | None = None) -> None:
        """kubelet's ``/var/log/containers`` link (``pod_uid``: a different pod's UID)."""
        link = (
            self.logs
            / f"{target.pod}_{target.namespace}_{target.container}-{target.container_id}.log"
        )
        pod_dir = f"{target.namespace}_{target.pod}_{pod_uid or target.pod_uid}"
        link.unlink(missing_ok=True)
        link.symlink_to(f"/var/log/pods/{pod_dir}/{target.container}/0.log")

    def reuse(self, pid: int) -> None:
        """``pid`` now names another process: same cgroup, a later start time."""
        stat = self.proc / str(pid) / "stat"
        text = Path(f"/proc/{pid}/stat").read_text()
        head, _, rest = text.rpartition(")")
        fields = rest.split()
        fields[19] = str(int(fields[19]) + 1000)
        stat.unlink()
        stat.write_text(f"{head}) {' '.join(fields)}\n")

    def close(self) -> None:
        for child in self.children:
            if child.poll() is None:
                child.kill()
            child.wait()
