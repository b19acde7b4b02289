"""The node agents for a real kubelet, run by the suite on this machine with fake cards:
``fracgpu device-plugin`` (:class:`NodeAgent`, FRACGPU_E2E_NODE) and ``fracgpu dra-plugin``
(:class:`DraAgent`, FRACGPU_E2E_DRA_NODE), with the helpers both kinds of scenario use.

The node named by FRACGPU_E2E_NODE must let this machine serve its kubelet:

* FRACGPU_E2E_KUBELET_DIR (default /var/lib/kubelet) is that kubelet's ``--root-dir`` as this
  machine sees it (``pod-resources/kubelet.sock`` must be there), and
  FRACGPU_E2E_DEVICE_PLUGIN_DIR (default: its ``device-plugins``) kubelet's device plugin
  directory (``kubelet.sock``, where plugins register). On a node that *is* this machine those
  are simply the defaults; for a kind or k3d node, bind-mount both directories out of the node
  container (docs/testing.md shows the cluster configuration).
* FRACGPU_E2E_NODE_DIR (default /var/lib/fracgpu-e2e) is a directory that the node's container
  runtime sees at the same path: the plugin's host files (hook library, limits files) and the
  fake card devices live there, and kubelet hands those paths to the runtime in Allocate.

For the DRA plugin, FRACGPU_E2E_KUBELET_DIR holds ``plugins_registry/`` (where kubelet finds
plugins) and ``plugins/`` (the plugin's socket, dialled by kubelet at the path the plugin
names, so kubelet must see it at the same path), and FRACGPU_E2E_CDI_DIR (default /var/run/cdi)
is where the node's container runtime reads CDI specs.

The cards come from the project's fake NVML (testkit/nvml, compiled here); their device
nodes are character devices with /dev/null's numbers: a runtime that applies CDI (containerd
2.x) refuses a device path that is not a device node, a symbolic link to /dev/null included.
Containers run the pause image, which never loads the hook.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from core import contract, dra
from core.kube import NODES, call_json
from core.quantity import parse_quantity
from deviceplugin.dra import cdi
from deviceplugin.dra.config import DEFAULT_DRIVER
from deviceplugin.shared.settings import DEFAULT_PROCESS_OVERHEAD_MIB
from testkit.nvml import FakeCard, FakeNvml, build_cached
from tests.e2e.harness import (
    CARD_MIB,
    CARD_PRODUCT,
    ENV_CDI_DIR,
    ENV_DEVICE_PLUGIN_DIR,
    ENV_KUBELET_DIR,
    ROOT,
    HarnessError,
    Kubectl,
    Settings,
    fracgpu_command,
    free_port,
)
from tests.e2e.scenarios import SHELL_IMAGE, container, manifest

CARDS = 4
# Devices that Allocate hands to a container besides the card itself (deviceplugin.classic.plugin).
CONTROL_DEVICES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")
HOOK = ROOT / "native" / "build" / "libfracgpu.so"


def fake_cards(count: int = CARDS) -> list[FakeCard]:
    return [
        FakeCard(f"GPU-e2e{i:05d}-0000-4000-8000-{i:012x}", CARD_MIB, i, name=CARD_PRODUCT)
        for i in range(count)
    ]


Obj = dict[str, Any]
RUNNING_WITHIN_S = 120.0  # the first pod on a node may pull the pause image


class NodeAgent:
    """The device plugin process, with its files under ``settings.node_dir/<run>``."""

    # What the agent is called in its log's name, and where it writes a grant's limits file.
    name = "device-plugin"
    limits_pattern = f"containers/*/limits/{contract.LIMITS_FILE}"

    def __init__(
        self, settings: Settings, run_id: str, cards: list[FakeCard], log_dir: Path
    ) -> None:
        node = self.node_of(settings)
        assert node is not None
        self.node = node
        self.kubeconfig = settings.kubeconfig
        self.plugin_dir = settings.device_plugin_dir
        self.podresources = settings.kubelet_dir / "pod-resources" / "kubelet.sock"
        self.root = settings.node_dir / f"run-{run_id}"
        self.host_root = self.root / "host"
        self.dev_root = self.root / "dev"
        self.cdi_root = settings.cdi_dir  # each container's card reaches it through a spec here
        self.cards = cards
        # Beside the run's other logs, so it outlives the node files removed at the end.
        self.log_path = log_dir / f"{self.name}.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.nvml: FakeNvml | None = None
        self.health_port = free_port("127.0.0.1")

    @staticmethod
    def node_of(settings: Settings) -> str | None:
        return settings.node

    def check_node(self) -> None:
        """Fail with what to set when kubelet's side is not where this machine looks."""
        for socket_path, what, variable in (
            (
                self.plugin_dir / "kubelet.sock",
                "kubelet's device plugin registration socket",
                f"{ENV_DEVICE_PLUGIN_DIR} to its device plugin directory",
            ),
            (
                self.podresources,
                "kubelet's PodResources socket",
                f"{ENV_KUBELET_DIR} to its --root-dir",
            ),
        ):
            if not socket_path.is_socket():
                raise HarnessError(
                    f"{socket_path} ({what}) is not a socket on this machine: set {variable}, "
                    f"as this machine sees it, for node {self.node}'s kubelet (docs/e2e.md)"
                )

    def prepare(self) -> None:
        """Check the node's directories are reachable and lay out the agent's files."""
        self.check_node()
        if not HOOK.is_file():
            raise HarnessError(f"{HOOK} is missing; build it with `make setup` (or `make native`)")
        (self.host_root / "lib").mkdir(parents=True, exist_ok=True)
        shutil.copyfile(HOOK, self.host_root / "lib" / HOOK.name)
        self.dev_root.mkdir(parents=True, exist_ok=True)
        null = os.stat("/dev/null").st_rdev
        for name in [*(f"nvidia{c.minor}" for c in self.cards), *CONTROL_DEVICES]:
            node = self.dev_root / name
            node.unlink(missing_ok=True)
            os.mknod(node, 0o666 | stat.S_IFCHR, null)
        self.nvml = FakeNvml(self.root, self.cards)

    def command(self) -> list[str]:
        return [
            *fracgpu_command(),
            "device-plugin",
            "--plugin-dir", str(self.plugin_dir),
            "--pod-resources-socket", str(self.podresources),
            "--host-root", str(self.host_root),
            "--dev-root", str(self.dev_root),
            "--cdi-root", str(self.cdi_root),
            "--nvml-library", str(build_cached()),
            "--metrics-address", "127.0.0.1",
            "--metrics-port", str(self.health_port),
            "--node-name", self.node,
            "--kubeconfig", str(self.kubeconfig),
        ]  # fmt: skip

    def start(self) -> None:
        if self.process is not None:
            return
        assert self.nvml is not None, "prepare() first"
        with self.log_path.open("ab") as log_file:
            self.process = subprocess.Popen(
                self.command(),
                stdout=log_file,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                env={**os.environ, **self.nvml.env(), "PYTHONUNBUFFERED": "1"},
            )

    def stop(self) -> None:
        if self.process is None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=5)
        self.process = None

    def registered(self) -> bool:
        """The plugin's /healthz: serving and registered with kubelet, health thread running."""
        url = f"http://127.0.0.1:{self.health_port}/healthz"
        try:
            with urllib.request.urlopen(url, timeout=2) as reply:
                return bool(reply.status == 200)
        except (OSError, urllib.error.URLError):
            return False

    def exited(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def written(self) -> dict[Path, int]:
        """Every limits file the plugin has written, with its modification time: a snapshot to
        pass to :meth:`limits` (a time window would also catch the previous test's last file)."""
        return {p: p.stat().st_mtime_ns for p in self.host_root.glob(self.limits_pattern)}

    def limits(self, before: dict[Path, int]) -> list[contract.Limits]:
        """The limits files the plugin wrote (or rewrote) since the snapshot ``before``."""
        return [
            contract.Limits.parse(p.read_text())
            for p, mtime in self.written().items()
            if before.get(p) != mtime
        ]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path.exists() else ""

    def remove_files(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


class DraAgent(NodeAgent):
    """``fracgpu dra-plugin`` for the kubelet of FRACGPU_E2E_DRA_NODE: registered through
    ``plugins_registry/``, serving under ``plugins/<driver>/``, its CDI specs where the node's
    runtime reads them, its host files (hook, limits, accounting) under the node directory."""

    name = "dra-plugin"
    limits_pattern = f"claims/*/limits/{contract.LIMITS_FILE}"

    def __init__(
        self, settings: Settings, run_id: str, cards: list[FakeCard], log_dir: Path
    ) -> None:
        super().__init__(settings, run_id, cards, log_dir)
        self.kubelet_root = settings.kubelet_dir
        self.cdi_root = settings.cdi_dir
        self.driver = DEFAULT_DRIVER

    @staticmethod
    def node_of(settings: Settings) -> str | None:
        return settings.dra_node

    def check_node(self) -> None:
        registry = self.kubelet_root / "plugins_registry"
        if not registry.is_dir():
            raise HarnessError(
                f"{registry} (where kubelet finds plugins) is not a directory on this machine: "
                f"set {ENV_KUBELET_DIR} to node {self.node}'s kubelet --root-dir as "
                f"this machine sees it (docs/e2e.md)"
            )
        if not self.cdi_root.is_dir():
            raise HarnessError(
                f"{self.cdi_root} (where the container runtime reads CDI specs) is not a "
                f"directory on this machine: set {ENV_CDI_DIR} to node {self.node}'s "
                f"CDI directory as this machine sees it (docs/e2e.md)"
            )

    def command(self) -> list[str]:
        return [
            *fracgpu_command(),
            "dra-plugin",
            "--driver-name", self.driver,
            "--node-name", self.node,
            "--kubeconfig", str(self.kubeconfig),
            "--kubelet-root", str(self.kubelet_root),
            "--cdi-root", str(self.cdi_root),
            "--host-root", str(self.host_root),
            "--dev-root", str(self.dev_root),
            "--nvml-library", str(build_cached()),
            "--metrics-address", "127.0.0.1",
            "--metrics-port", str(self.health_port),
        ]  # fmt: skip

    def cdi_specs(self) -> dict[str, Path]:
        """The CDI specs the plugin wrote, by claim UID (one per prepared claim)."""
        return dict(cdi.specs(self.cdi_root, self.driver))


def results(claim: Obj) -> list[Obj]:
    """The allocation results of fracgpu's driver in a claim the scheduler placed."""
    allocation = (claim.get("status") or {}).get("allocation") or {}
    found: list[Obj] = [
        r for r in (allocation.get("devices") or {}).get("results") or []
        if r.get("driver") == dra.DRIVER
    ]  # fmt: skip
    return found


def consumed(claim: Obj) -> tuple[int, int]:
    """(cores, memory bytes) the scheduler charged the claim's one share: what the limits file
    the plugin writes for it must hold."""
    (result,) = results(claim)
    return consumed_of(result)


def consumed_of(result: Obj) -> tuple[int, int]:
    """(cores, memory bytes) the scheduler charged one allocation result."""
    capacity = result["consumedCapacity"]
    cores = int(parse_quantity(capacity[dra.CORES]).value)
    return cores, int(parse_quantity(capacity[dra.MEMORY]).value)


# --- what both kinds of scenario do with pods on the node ---------------------------------------


def wait_for(check: Callable[[], bool], within_s: float, explain: Callable[[], str]) -> float:
    """Seconds until ``check`` holds; fails with ``explain()`` when it does not in time."""
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > within_s:
            pytest.fail(f"not within {within_s:g}s:\n{explain()}")
        time.sleep(0.2)
    return time.monotonic() - start


def node_pod(name: str, node: str, limits: Obj, *, grace_s: int = 0) -> Obj:
    """A pod pinned to ``node``. ``grace_s`` > 0 makes deleting it graceful, as users and
    controllers delete: the API server keeps the pod until kubelet has stopped it, so the
    scheduler sees its capacity free only once kubelet does. With 0 a delete removes the pod at
    once, and the scheduler may place a pod on capacity that kubelet, still stopping the old
    one, counts as held: kubelet refuses it (UnexpectedAdmissionError, for any extended
    resource, with any device plugin)."""
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchFields": [
            {"key": "metadata.name", "operator": "In", "values": [node]}]}]}}}  # fmt: skip
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "containers": [container("main", limits)],
            "affinity": affinity,
            "tolerations": [{"operator": "Exists"}],  # a one-node cluster's control plane
            "terminationGracePeriodSeconds": grace_s,
        },
    }


def pods(kubectl: Kubectl, namespace: str) -> list[Obj]:
    items: list[Obj] = json.loads(kubectl.ok("get", "pods", "-n", namespace, "-o", "json"))["items"]
    return items


def describe(kubectl: Kubectl, namespace: str, agent: NodeAgent) -> str:
    events = kubectl("get", "events", "-n", namespace, "--sort-by=.lastTimestamp").stdout
    return f"events:\n{events[-3000:]}\n{agent.name} log:\n{agent.log()}"


def create(kubectl: Kubectl, namespace: str, obj: Obj) -> Obj:
    kubectl.ok("create", "-n", namespace, "-f", "-", stdin=manifest(obj))
    return kubectl.get("pod", obj["metadata"]["name"], namespace)


def wait_running(kubectl: Kubectl, namespace: str, name: str, agent: NodeAgent) -> float:
    def running() -> bool:
        phase = kubectl.get("pod", name, namespace)["status"].get("phase")
        assert phase != "Failed", describe(kubectl, namespace, agent)
        return bool(phase == "Running")

    return wait_for(running, RUNNING_WITHIN_S, lambda: describe(kubectl, namespace, agent))


def container_pids(kubectl: Kubectl, namespace: str, pod: str, name: str = "main") -> list[int]:
    """The node's pids of a running container: the processes whose cgroup names its ID (this
    machine is the node, as the guard sees it)."""
    statuses = kubectl.get("pod", pod, namespace)["status"].get("containerStatuses") or []
    (entry,) = [s for s in statuses if s["name"] == name]
    container_id = str(entry["containerID"]).split("://", 1)[1]
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if container_id in (proc / "cgroup").read_text():
                found.append(int(proc.name))
        except OSError:
            continue
    return found


def restarts(kubectl: Kubectl, namespace: str, pod: str) -> int:
    statuses = kubectl.get("pod", pod, namespace)["status"].get("containerStatuses") or []
    return sum(int(s.get("restartCount") or 0) for s in statuses)


def guard_kills_over_grant(
    agent: NodeAgent, kubectl: Kubectl, namespace: str, pod: str, *, card: int, grant_mib: int
) -> None:
    """The node guard on the real kubelet: the pod's process shows (in the fake NVML) exactly
    its grant plus the guard's allowance for a CUDA context, and is left alone; then more, and
    the guard kills it (kubelet restarts the container) and tells the pod in an Event."""
    (pid,) = container_pids(kubectl, namespace, pod)
    allowance = DEFAULT_PROCESS_OVERHEAD_MIB
    agent.nvml.process(card, pid, grant_mib + allowance)
    try:
        time.sleep(3)  # several scans and more than the grace
        assert restarts(kubectl, namespace, pod) == 0, describe(kubectl, namespace, agent)
        agent.nvml.process(card, pid, grant_mib + allowance + 256)
        wait_for(
            lambda: restarts(kubectl, namespace, pod) >= 1,
            30,
            lambda: describe(kubectl, namespace, agent),
        )
        wait_for(
            lambda: (
                "GPUProcessKilled"
                in kubectl(
                    "get",
                    "events",
                    "-n",
                    namespace,
                    "--field-selector",
                    f"involvedObject.name={pod}",
                ).stdout
            ),
            30,
            lambda: describe(kubectl, namespace, agent),
        )
    finally:
        agent.nvml.exit(card, pid)


async def node_metadata(api: Any, node: str) -> dict[str, Any]:
    metadata: dict[str, Any] = (await call_json(api, "GET", NODES.path(name=node)))["metadata"]
    return metadata


async def unpublish(api: Any, node: str, before: dict[str, Any]) -> None:
    """Remove the labels and annotations the agent put on the Node, and only those."""
    after = await node_metadata(api, node)
    patch: dict[str, Any] = {}
    for field in ("labels", "annotations"):
        added = set(after.get(field) or {}) - set(before.get(field) or {})
        if added:
            patch[field] = dict.fromkeys(added)
    if patch:
        await call_json(
            api,
            "PATCH",
            NODES.path(name=node),
            body={"metadata": patch},
            content_type="application/merge-patch+json",
        )


def _agent_metrics(agent: NodeAgent) -> str:
    url = f"http://127.0.0.1:{agent.health_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as reply:
        return str(reply.read().decode())


def top_shows_live_use(
    agent: NodeAgent, kubectl: Kubectl, namespace: str, pod: str, *, card: int, label: str
) -> None:
    """`kubectl fracgpu top` shows what the pod's process uses, read through the API server's
    proxy to a node agent pod. The suite's agent runs beside the cluster, not as a pod: a
    stand-in pod (busybox httpd, the agent's name ``label``, port ``metrics``) serves what the
    real agent exports at that moment for the pod's process (in the fake NVML: 1000 MiB, 37 %
    of the SMs), and top must find it on the card, by the card's UUID."""
    (pid,) = container_pids(kubectl, namespace, pod)
    agent.nvml.process(card, pid, 1000)
    agent.nvml.busy(card, pid, 37)
    try:
        series = f'pod="{pod}"'
        wait_for(
            lambda: (
                series in _agent_metrics(agent) and "share_compute_used" in _agent_metrics(agent)
            ),
            15,
            agent.log,
        )
        exported = _agent_metrics(agent)
        kubectl.ok(
            "create", "configmap", "agent-metrics", "-n", namespace,
            f"--from-literal=metrics={exported}",
        )  # fmt: skip
        stand_in = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "stand-in-agent", "labels": {"app.kubernetes.io/name": label}},
            "spec": {
                "nodeName": agent.node,
                "tolerations": [{"operator": "Exists"}],
                "containers": [{
                    "name": "metrics",
                    "image": SHELL_IMAGE,
                    "command": ["busybox", "httpd", "-f", "-p", "9402", "-h", "/www"],
                    "ports": [{"name": "metrics", "containerPort": 9402}],
                    "volumeMounts": [{"name": "www", "mountPath": "/www"}],
                }],
                "volumes": [{"name": "www", "configMap": {"name": "agent-metrics"}}],
                "terminationGracePeriodSeconds": 0,
            },
        }  # fmt: skip
        kubectl.ok("create", "-n", namespace, "-f", "-", stdin=manifest(stand_in))
        wait_running(kubectl, namespace, "stand-in-agent", agent)

        def shown() -> dict[str, Any] | None:
            top = kubectl.fracgpu("top", "--node", agent.node, "-n", namespace, "-o", "json")
            assert top.returncode == 0, top.stderr
            for entry in json.loads(top.stdout)["cards"]:
                for share in entry["shares"]:
                    if share["pod"] == pod and share["used_mib"] is not None:
                        return {"card": entry["uuid"], **share}
            return None

        wait_for(lambda: shown() is not None, 20, lambda: describe(kubectl, namespace, agent))
        found = shown()
        assert found is not None
        assert found["card"] == agent.cards[card].uuid, found
        assert (found["used_mib"], found["busy_percent"]) == (1000, 37), found
    finally:
        agent.nvml.exit(card, pid)
        kubectl("delete", "pod", "stand-in-agent", "-n", namespace, "--force", "--grace-period=0")
        kubectl("delete", "configmap", "agent-metrics", "-n", namespace)


def a_burst_is_lent_idle_compute_and_a_cap_is_not(
    agent: NodeAgent, kubectl: Kubectl, namespace: str
) -> None:
    """Two shares of 0.3 card, each with a process keeping 37 % of the SMs busy (fake NVML): one
    asks 0.3 in requests and 1 in limits (it may burst), the other is a hard cap. Inside each
    container the node agent's usage file says the share's own use (37) and its ceiling: 30 for
    the cap; for the burst, what the card's active shares are not guaranteed (100 alone on its
    card, 70 beside the cap)."""
    bursting = {"requests": {"fracgpu.io/gpu": "0.3"},
                "limits": {"fracgpu.io/gpu": "1", "fracgpu.io/gpumem": "4Gi"}}  # fmt: skip
    for name, resources in (
        ("burst", bursting),
        ("capped", {"limits": {"fracgpu.io/gpu": "0.3", "fracgpu.io/gpumem": "4Gi"}}),
    ):
        obj = node_pod(name, agent.node, {})
        obj["spec"]["containers"][0].update(
            image=SHELL_IMAGE, command=["sleep", "3600"], resources=resources
        )
        create(kubectl, namespace, obj)
    for name in ("burst", "capped"):
        wait_running(kubectl, namespace, name, agent)

    def inside(pod: str, name: str) -> str:
        return kubectl.ok(
            "exec", "-n", namespace, pod, "--", "cat", f"{contract.CONTAINER_LIMITS_DIR}/{name}"
        )

    cards = {
        pod: next(
            i
            for i, c in enumerate(agent.cards)
            if c.uuid == contract.Limits.parse(inside(pod, contract.LIMITS_FILE)).devices[0]
        )
        for pod in ("burst", "capped")
    }
    pids = {pod: container_pids(kubectl, namespace, pod) for pod in cards}
    for pod, card in cards.items():
        for pid in pids[pod]:
            agent.nvml.process(card, pid, 500)
            agent.nvml.busy(card, pid, 37)
    try:

        def usage(pod: str) -> contract.ShareUsage | None:
            proc = kubectl("exec", "-n", namespace, pod, "--", "cat",
                           f"{contract.CONTAINER_LIMITS_DIR}/{contract.USAGE_FILE}")  # fmt: skip
            if proc.returncode != 0:
                return None
            return contract.ShareUsage.parse(proc.stdout)

        lent = 70 if cards["burst"] == cards["capped"] else 100
        expected = {"burst": (37, lent), "capped": (37, 30)}

        def told() -> bool:
            for pod, want in expected.items():
                found = usage(pod)
                if found is None or (found.used_percent, found.ceiling_percent) != want:
                    return False
            return True

        wait_for(told, 20, lambda: f"{ {p: usage(p) for p in expected} } != {expected}")
    finally:
        for pod, card in cards.items():
            for pid in pids[pod]:
                agent.nvml.exit(card, pid)
