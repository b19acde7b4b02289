"""fracgpu installed as a user installs it: ``helm install`` of deploy/helm/fracgpu with the image
``make image`` built, on a node that has no GPU.

What a GPU-less node needs, and nothing else, goes into the release's values beside the image
and the cluster's paths (:func:`node_values`): the project's fake NVML library and its card
list, the fake cards' device nodes, an NVIDIA container toolkit configuration as a GPU node
has one, all in one host folder that the node agent mounts at the same path. Everything else
is the chart as shipped: the webhook's two replicas and their Service, its certificates issued
in the cluster, the quota leader Lease, the node agent's DaemonSet with its init containers,
the scheduler profile's Deployment.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from core import contract
from core.dra import DRIVER
from testkit.nvml import FakeCard, FakeNvml, build_cached
from tests.deploy_render import CHART, helm
from tests.e2e.harness import CARD_MIB, CARD_PRODUCT, Kubectl, Settings
from tests.e2e.nodeagent import wait_for
from tests.e2e.scenarios import SHELL_IMAGE, manifest

Obj = dict[str, Any]
RELEASE = "fracgpu"
# The release's namespace, as docs/install.md installs it.
NAMESPACE = "fracgpu"
# The label the chart's node agents select GPU nodes by.
GPU_NODE_LABEL = "nvidia.com/gpu.present"


def fake_cards(count: int) -> list[FakeCard]:
    """``count`` fake cards of the suite's model, with the same UUIDs in every session."""
    return [
        FakeCard(f"GPU-rel{i:05d}-0000-4000-8000-{i:012x}", CARD_MIB, i, name=CARD_PRODUCT)
        for i in range(count)
    ]


# The release's node, unless a scenario asks for more cards.
CARDS = fake_cards(2)
# The project's cluster runs no cluster DNS, so in device-plugin mode the chart's scheduler
# dials the extender at the webhook Service's IP, pinned inside the cluster's service range
# (the TLS server name stays the Service's DNS name): what docs/install.md tells a cluster
# without DNS to set.
EXTENDER_IP = "10.96.211.44"
# Devices Allocate and the CDI specs hand a container besides its card.
CONTROL_DEVICES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")
# A GPU node's toolkit configured as docs/install.md says (the device plugin's init container
# checks it and refuses to start otherwise).
TOOLKIT_CONFIG = (
    "accept-nvidia-visible-devices-envvar-when-unprivileged = false\n"
    "accept-nvidia-visible-devices-as-volume-mounts = true\n"
)
READY_WITHIN_S = 240.0


class Helm:
    """helm with the cluster's kubeconfig, in the release's namespace; fails with helm's
    stderr."""

    def __init__(self, kubeconfig: Path, namespace: str = NAMESPACE) -> None:
        self.base = [helm(), "--kubeconfig", str(kubeconfig), "--namespace", namespace]

    def __call__(self, *args: str, timeout: float = 300) -> str:
        proc = subprocess.run(
            [*self.base, *args], capture_output=True, text=True, timeout=timeout, check=False
        )
        assert proc.returncode == 0, f"helm {' '.join(args)} failed:\n{proc.stderr}"
        return proc.stdout

    def manifest(self, release: str = RELEASE) -> list[Obj]:
        return [doc for doc in yaml.safe_load_all(self("get", "manifest", release)) if doc]


@dataclass(frozen=True)
class NodeFiles:
    """The fake GPU of the node: one host folder, mounted into the node agent at its own path."""

    root: Path
    cards: tuple[FakeCard, ...] = tuple(CARDS)

    @property
    def library(self) -> Path:
        return self.root / "libnvidia-ml.so.1"

    @property
    def dev(self) -> Path:
        return self.root / "dev"

    @property
    def toolkit(self) -> Path:
        return self.root / "nvidia-container-runtime"

    def make(self) -> FakeNvml:
        self.root.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(build_cached(), self.library)
        self.dev.mkdir(exist_ok=True)
        null = os.stat("/dev/null").st_rdev
        for name in [*(f"nvidia{c.minor}" for c in self.cards), *CONTROL_DEVICES]:
            node = self.dev / name
            node.unlink(missing_ok=True)
            os.mknod(node, 0o666 | stat.S_IFCHR, null)
        self.toolkit.mkdir(exist_ok=True)
        (self.toolkit / "config.toml").write_text(TOOLKIT_CONFIG)
        return FakeNvml(self.root, list(self.cards))

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def image_parts(image: str) -> tuple[str, str]:
    """``repository:tag`` split at the tag's colon (a registry's port has one too)."""
    repository, _, tag = image.rpartition(":")
    if not repository or "/" in tag:
        raise ValueError(f"{image!r} names no tag; give the image as repository:tag")
    return repository, tag


def chart_version() -> str:
    """The chart's appVersion: the image tag it installs unless told otherwise."""
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    return str(chart["appVersion"])


def node_values(settings: Settings, files: NodeFiles, nvml: FakeNvml, mode: str) -> Obj:
    """The values a GPU-less node of this cluster adds to the chart's: where the images it holds
    come from (no registry), the kubelet's and the runtime's folders, the fake GPU, and in
    device-plugin mode where the scheduler reaches the extender without cluster DNS."""
    assert settings.release_image and settings.scheduler_image
    _, tag = image_parts(settings.release_image)
    scheduler_repository, _ = image_parts(settings.scheduler_image)
    mount = {"name": "fake-gpu", "mountPath": str(files.root), "readOnly": True}
    values: Obj = {
        "scheduler": {"image": {"repository": scheduler_repository}},
        "nodeAgent": {
            "kubeletDir": str(settings.kubelet_dir),
            "cdiDir": str(settings.cdi_dir),
            "toolkitConfigDir": str(files.toolkit),
            "extraArgs": [f"--dev-root={files.dev}", f"--nvml-library={files.library}"],
            "extraEnv": [{"name": k, "value": v} for k, v in sorted(nvml.env().items())],
            "extraVolumes": [
                {"name": "fake-gpu", "hostPath": {"path": str(files.root), "type": "Directory"}}
            ],
            "extraVolumeMounts": [mount],
        },
    }
    if tag != chart_version():
        values["image"] = {"tag": tag}
    if mode == "device-plugin":
        values["webhook"] = {"serviceClusterIP": EXTENDER_IP}
        values["scheduler"]["extenderHost"] = EXTENDER_IP
    return values


def merged(base: Obj, extra: Obj) -> Obj:
    """``extra`` over ``base``, mappings merged key by key (as Helm merges values files)."""
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = value
    return out


def write_values(path: Path, values: Obj) -> Path:
    path.write_text(yaml.safe_dump(values, sort_keys=False))
    return path


def install_args(settings: Settings, mode: str, values_file: Path) -> list[str]:
    """``helm install`` exactly as docs/install.md's first example has it (the namespace is
    Helm's --namespace), plus the node's values; the mode is the chart's choice (auto: DRA on
    1.36 and newer) unless it is device-plugin."""
    assert settings.release_image and settings.scheduler_image
    repository, _ = image_parts(settings.release_image)
    _, scheduler_tag = image_parts(settings.scheduler_image)
    args = [
        "install", RELEASE, str(CHART), "--create-namespace",
        "--set", f"image.repository={repository}", "--set", f"scheduler.image.tag={scheduler_tag}",
        "--wait", "--timeout", f"{int(READY_WITHIN_S)}s", "-f", str(values_file),
    ]  # fmt: skip
    if mode == "device-plugin":
        args += ["--set", "mode=device-plugin"]
    return args


def namespace_usable(kubectl: Kubectl, name: str) -> bool:
    """Not being deleted (an earlier e2e session's webhook identity lived in ``fracgpu``)."""
    out = kubectl("get", "namespace", name, "-o", "jsonpath={.status.phase}")
    return out.returncode != 0 or out.stdout.strip() != "Terminating"


def pods_of(kubectl: Kubectl, selector: str, namespace: str = NAMESPACE) -> list[Obj]:
    out = kubectl.ok("get", "pods", "-n", namespace, "-l", selector, "-o", "json")
    items: list[Obj] = json.loads(out)["items"]
    return items


def ready(pod: Obj) -> bool:
    conditions = pod.get("status", {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def release_state(kubectl: Kubectl) -> str:
    """What an operator would look at when the release does not come up."""
    parts = [
        kubectl("get", "pods,deploy,ds,lease", "-n", NAMESPACE, "-o", "wide").stdout,
        kubectl("get", "events", "-n", NAMESPACE, "--sort-by=.lastTimestamp").stdout[-4000:],
    ]
    for pod in pods_of(kubectl, "app.kubernetes.io/part-of=fracgpu"):
        name = pod["metadata"]["name"]
        logs = kubectl("logs", "-n", NAMESPACE, name, "--all-containers", "--tail=30").stdout
        parts.append(f"--- {name} ---\n{logs}")
    return "\n".join(parts)


AGENT = {"device-plugin": "fracgpu-device-plugin", "dra": "fracgpu-dra-plugin"}
WEBHOOK_SELECTOR = "app.kubernetes.io/name=fracgpu-webhook"
RUNNING_WITHIN_S = 120.0


class Release:
    def __init__(
        self, mode: str, settings: Settings, kubectl: Kubectl, helm_: Helm, files: NodeFiles
    ) -> None:
        self.mode = mode
        self.settings = settings
        self.kubectl = kubectl
        self.helm = helm_
        self.files = files
        self.installed: list[Obj] = []
        self.uninstalled = False
        # fracgpu's files on the node before the release (the harness's own node agents, run
        # beside the cluster in the sessions before, leave theirs in the same folders)
        self.before = set(host_files(settings))

    def left_on_node(self) -> list[str]:
        """What the release wrote on the node and left there."""
        return sorted(set(host_files(self.settings)) - self.before)

    @property
    def agent(self) -> str:
        return AGENT[self.mode]

    def agent_pod(self) -> Obj:
        (pod,) = pods_of(self.kubectl, f"app.kubernetes.io/name={self.agent}")
        return pod


@contextlib.contextmanager
def installed(
    mode: str,
    node: str,
    settings: Settings,
    kubectl: Kubectl,
    workdir: Path,
    *,
    extra_values: Obj | None = None,
    cards: int = len(CARDS),
) -> Iterator[Release]:
    """The chart installed in ``mode`` and Ready (``helm install --wait``), with the node's
    values (``cards`` fake cards) and ``extra_values`` (a user's own); uninstalled, with the
    node's label and fake GPU removed, whatever happened."""
    files = NodeFiles(settings.node_dir / f"release-{mode}", tuple(fake_cards(cards)))
    nvml = files.make()
    values = write_values(
        workdir / "node-values.yaml",
        merged(node_values(settings, files, nvml, mode), extra_values or {}),
    )
    run = Release(mode, settings, kubectl, Helm(settings.kubeconfig), files)
    kubectl.ok("label", "node", node, f"{GPU_NODE_LABEL}=true", "--overwrite")
    try:
        try:
            wait_for(
                lambda: namespace_usable(kubectl, NAMESPACE),
                120,
                lambda: kubectl("get", "namespace", NAMESPACE, "-o", "yaml").stdout,
            )
            run.helm(*install_args(settings, mode, values), timeout=READY_WITHIN_S + 60)
        except AssertionError as err:
            raise AssertionError(f"{err}\n{release_state(kubectl)}") from None
        run.installed = run.helm.manifest()
        yield run
    finally:
        if not run.uninstalled:
            with contextlib.suppress(AssertionError):
                run.helm("uninstall", RELEASE, "--wait", "--ignore-not-found")
        kubectl("label", "node", node, f"{GPU_NODE_LABEL}-")
        kubectl("delete", "namespace", NAMESPACE, "--wait=true", "--timeout=120s")
        files.remove()
        # What a failed run left on the node goes too, so the next run starts clean (the
        # uninstall scenario has already said what it found).
        for left in host_files(settings):
            path = Path(left)
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)


def share_pod(name: str, gpu: str, gpumem: str, *, scheduler: str | None = None) -> Obj:
    """A user's pod: a shell that sleeps, with a share of a card."""
    spec: Obj = {
        "containers": [{
            "name": "main", "image": SHELL_IMAGE, "command": ["sleep", "3600"],
            "resources": {"limits": {"fracgpu.io/gpu": gpu, "fracgpu.io/gpumem": gpumem}},
        }],
        "terminationGracePeriodSeconds": 1,
    }  # fmt: skip
    if scheduler:
        spec["schedulerName"] = scheduler
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def events(kubectl: Kubectl, namespace: str) -> str:
    return kubectl("get", "events", "-n", namespace, "--sort-by=.lastTimestamp").stdout[-3000:]


def create_running(kubectl: Kubectl, namespace: str, obj: Obj) -> Obj:
    kubectl.ok("create", "-n", namespace, "-f", "-", stdin=manifest(obj))
    name = obj["metadata"]["name"]

    def running() -> bool:
        phase = kubectl.get("pod", name, namespace)["status"].get("phase")
        assert phase != "Failed", events(kubectl, namespace)
        return bool(phase == "Running")

    wait_for(running, RUNNING_WITHIN_S,
             lambda: f"{events(kubectl, namespace)}\n{release_state(kubectl)}")  # fmt: skip
    return kubectl.get("pod", name, namespace)


def inside(kubectl: Kubectl, namespace: str, pod: str, *command: str) -> str:
    return kubectl.ok("exec", "-n", namespace, pod, "--", *command)


def limits_inside(kubectl: Kubectl, namespace: str, pod: str) -> contract.Limits:
    path = f"{contract.CONTAINER_LIMITS_DIR}/{contract.LIMITS_FILE}"
    return contract.Limits.parse(inside(kubectl, namespace, pod, "cat", path))


def restarts(pod: Obj) -> int:
    statuses = pod["status"].get("containerStatuses") or []
    return sum(int(s.get("restartCount") or 0) for s in statuses)


def host_files(settings: Settings) -> list[str]:
    """What of fracgpu's is on the node: under the chart's host root (whose folder, the node
    agent's mount point, may stay), fracgpu's CDI specs, its kubelet sockets and folders."""
    kubelet = settings.kubelet_dir
    found = [str(p) for p in HOST_ROOT.rglob("*")] if HOST_ROOT.is_dir() else []
    found += [str(p) for p in settings.cdi_dir.glob("*fracgpu*")]
    found += [str(p) for p in settings.device_plugin_dir.glob("fracgpu*")]
    found += [str(p) for p in (kubelet / "plugins_registry").glob("*fracgpu*")]
    found += [str(p) for p in (kubelet / "plugins").glob("*fracgpu*")]
    return sorted(found)


HOST_ROOT = Path("/var/lib/fracgpu")


def release_node_of(settings: Settings) -> str | None:
    """The node the release's scenarios may give a node agent, when everything they need is
    set (make e2e sets it all); None: they skip, saying what is missing."""
    if settings.release_node and settings.release_image and settings.scheduler_image:
        return settings.release_node
    return None


SKIP_REASON = (
    "the installed release's scenarios need FRACGPU_E2E_RELEASE_NODE, FRACGPU_E2E_RELEASE_IMAGE "
    "and FRACGPU_E2E_SCHEDULER_IMAGE (make e2e sets them)"
)


@contextlib.contextmanager
def user_namespace(kubectl: Kubectl) -> Iterator[str]:
    """A namespace as a user has one: nothing of the suite's, only the release's webhooks."""
    name = f"fracgpu-e2e-user-{os.urandom(3).hex()}"
    kubectl.ok("create", "namespace", name)
    kubectl.ok("label", "namespace", name, "fracgpu.io/e2e=true")
    try:
        yield name
    finally:
        kubectl("delete", "namespace", name, "--wait=false")


def webhooks_settled(kubectl: Kubectl) -> bool:
    """The webhook's rollout has ended: every replica of the current template Ready, no old one
    left (a stopping replica answers for a few seconds more, with the old configuration), and
    the Service's endpoints exactly the current replicas."""
    deployment = kubectl.get("deployment", "fracgpu-webhook", NAMESPACE)
    want, status = deployment["spec"]["replicas"], deployment.get("status") or {}
    counts = (status.get("updatedReplicas"), status.get("readyReplicas"), status.get("replicas"))
    pods = pods_of(kubectl, WEBHOOK_SELECTOR)
    if counts != (want, want, want) or len(pods) != want or not all(ready(p) for p in pods):
        return False
    return webhook_endpoints(kubectl) == {p["status"]["podIP"] for p in pods}


def webhook_endpoints(kubectl: Kubectl) -> set[str]:
    """The addresses the webhook's Service sends the API server's calls to."""
    slices = json.loads(kubectl.ok(
        "get", "endpointslices", "-n", NAMESPACE,
        "-l", "kubernetes.io/service-name=fracgpu-webhook", "-o", "json",
    ))["items"]  # fmt: skip
    return {a for s in slices for e in s.get("endpoints") or [] for a in e["addresses"]}


def published_left(kubectl: Kubectl) -> list[str]:
    """What the node agents published in the API and is still there: their keys on the Nodes
    and fracgpu's ResourceSlices (the chart's post-delete hook removes them)."""
    left = []
    for node in json.loads(kubectl.ok("get", "nodes", "-o", "json"))["items"]:
        meta = node["metadata"]
        for where in ("labels", "annotations"):
            for key in meta.get(where) or {}:
                if key.startswith("fracgpu.io/gpu."):
                    left.append(f"node {meta['name']} {where[:-1]} {key}")
    slices = json.loads(kubectl.ok(
        "get", "resourceslices", "-o", "json", "--field-selector", f"spec.driver={DRIVER}",
    ))["items"]  # fmt: skip
    left += [f"ResourceSlice {s['metadata']['name']}" for s in slices]
    return left
