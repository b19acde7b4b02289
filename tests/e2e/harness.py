"""The e2e harness: everything the suite sets up in a real cluster, and takes down again.

A run (:func:`e2e_run`) installs the GPUQuota CRD from deploy/crds unless the cluster already has
it, starts ``fracgpu serve`` on this machine with a certificate from the project's own issuance
code, registers deploy/'s two webhook configurations for it by URL (with that certificate's CA
as caBundle, confined to the run's namespaces), and removes all of it on the way out, whatever
happened in between. Nothing else in the cluster is touched. The harness talks to the API server
through the project's client (``core.kube``); the tests use ``kubectl`` where what a user sees is
the point. tests/test_deploy_e2e_harness.py runs this module against the fake API server.
See docs/e2e.md for the variables and how to point it at kind, k3d or any cluster.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime
import ipaddress
import json
import logging
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Coroutine, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

import yaml

from certs.issuance import issue_ca, issue_serving
from core.kube import (
    DEVICE_CLASSES,
    GPUQUOTAS,
    LEASES,
    MUTATING_WEBHOOK_CONFIGURATIONS,
    NAMESPACES,
    NODES,
    PODS,
    VALIDATING_WEBHOOK_CONFIGURATIONS,
    KubeConflict,
    KubeError,
    KubeInvalid,
    KubeNotFound,
    Resource,
    call_json,
    kube_client,
)
from webhook import server

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"

# The variables the suite reads (docs/e2e.md).
ENV_KUBECONFIG = "FRACGPU_E2E_KUBECONFIG"
ENV_HOST = "FRACGPU_E2E_WEBHOOK_HOST"
ENV_BIND = "FRACGPU_E2E_WEBHOOK_BIND"
ENV_PORT = "FRACGPU_E2E_WEBHOOK_PORT"
ENV_NODE = "FRACGPU_E2E_NODE"
ENV_KUBELET_DIR = "FRACGPU_E2E_KUBELET_DIR"
ENV_DEVICE_PLUGIN_DIR = "FRACGPU_E2E_DEVICE_PLUGIN_DIR"
ENV_NODE_DIR = "FRACGPU_E2E_NODE_DIR"
ENV_DRA_NODE = "FRACGPU_E2E_DRA_NODE"
ENV_CDI_DIR = "FRACGPU_E2E_CDI_DIR"
# The installed release's scenarios (test_e2e_release.py): the node given the release's node
# agent, fracgpu's image (`make image`) and a kube-scheduler image the nodes hold.
ENV_RELEASE_NODE = "FRACGPU_E2E_RELEASE_NODE"
ENV_RELEASE_IMAGE = "FRACGPU_E2E_RELEASE_IMAGE"
ENV_SCHEDULER_IMAGE = "FRACGPU_E2E_SCHEDULER_IMAGE"
# The image every scenario's containers run: on an air-gapped cluster, one its nodes already hold.
ENV_IMAGE = "FRACGPU_E2E_IMAGE"
DEFAULT_IMAGE = "registry.k8s.io/pause:3.10"
# An image with a shell and busybox's tools (sh, cat, ls, env, sleep), for the scenarios that look
# inside a running container.
ENV_SHELL_IMAGE = "FRACGPU_E2E_SHELL_IMAGE"
DEFAULT_SHELL_IMAGE = "docker.io/library/busybox:1.36"

# A label that only this run's objects carry: the webhook configurations select namespaces by it,
# so a run never touches any other namespace of a shared cluster, and leftovers can be found.
RUN_LABEL = "fracgpu.io/e2e-run"
# Every namespace the suite makes, of any run (docs/e2e.md: removing what a killed run left).
E2E_LABEL = "fracgpu.io/e2e"

# The one GPU model the local webhook knows: the fake cards the node agent scenarios advertise.
# A cluster without GPU nodes needs no more (pods stay Pending, which is enough for admission).
CARD_PRODUCT = "NVIDIA Fake GPU 24GB"
CARD_MIB = 24576

# The admission configuration passed to `fracgpu serve`, stated in full rather than left to
# defaults that may change: the scenarios compute what they expect from this same configuration.
# No fracgpu-scheduler runs in an e2e cluster, so GPU pods keep the cluster's default scheduler.
# Device-plugin mode, named: with the default (auto) a DeviceClass left by another run would
# switch the webhook to DRA mode.
ADMISSION: dict[str, Any] = {
    "allocation": "device-plugin",
    "scheduler_name": "",
    "inventory": {"models": {CARD_PRODUCT: CARD_MIB}, "watch_nodes": False},
}
# DRA mode (the DRA scenarios): the same admission with claims instead of extended resources.
# GPU models then come from the ResourceSlices the node agent publishes, not from this inventory.
ADMISSION_DRA: dict[str, Any] = {**ADMISSION, "allocation": "dra"}
# `fracgpu serve` runs as the webhook's ServiceAccount with the RBAC deploy/ grants it (its
# token, not the suite's admin credentials): a call the deployed webhook may not make fails
# here as it would in a cluster. Its namespace is deploy/'s, made by the run when missing.
WEBHOOK_NAMESPACE = "fracgpu"
WEBHOOK_ACCOUNT = "fracgpu-webhook"
# One local replica, leading a Lease of the run's own in the webhook's namespace (where its Role
# grants Leases): as in a cluster, and a test can take the Lease away to play a crashed leader.
LEASE_NAMESPACE = WEBHOOK_NAMESPACE


def lease_name(run_id: str) -> str:
    return f"fracgpu-e2e-{run_id}-quota"


def quota_config(run_id: str) -> Obj:
    return {
        "timeout_s": 4,
        "leader_election": {
            "lease_namespace": LEASE_NAMESPACE,
            "lease_name": lease_name(run_id),
            "identity": f"fracgpu-e2e-{run_id}",
            "renew_interval_s": 1.0,
        },
    }


CRDS = Resource("apiextensions.k8s.io", "v1", "customresourcedefinitions", namespaced=False)
_CONFIGURATIONS = {
    "MutatingWebhookConfiguration": MUTATING_WEBHOOK_CONFIGURATIONS,
    "ValidatingWebhookConfiguration": VALIDATING_WEBHOOK_CONFIGURATIONS,
}

Obj = dict[str, Any]
T = TypeVar("T")


class HarnessError(RuntimeError):
    """The run cannot be set up; the message says what to change."""


# --- settings -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    kubeconfig: Path
    host: str | None  # None: this machine's address on the route to the control plane
    bind: str | None  # None: the host if it is a loopback address, else every address
    port: int | None  # None: a free port (a fixed one suits firewall rules and tunnels)
    node: str | None  # the node whose kubelet the suite may give a fracgpu device plugin
    kubelet_dir: Path  # that kubelet's --root-dir as this machine sees it (pod-resources/)
    device_plugin_dir: Path  # its device plugin directory as this machine sees it
    node_dir: Path  # a directory that node sees at the same path (host files, fake devices)
    # The node on which the suite runs `fracgpu dra-plugin` (DRA scenarios); kubelet_dir is
    # then its --root-dir (plugins_registry/, plugins/) as this machine sees it.
    dra_node: str | None = None
    cdi_dir: Path = Path("/var/run/cdi")  # where that node's runtime reads CDI specs, from here
    # The node on which the installed release's node agent runs (test_e2e_release.py), and the
    # images it runs: fracgpu's, and kube-scheduler for the chart's scheduler profile.
    release_node: str | None = None
    release_image: str | None = None
    scheduler_image: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Settings | None:
        """None without FRACGPU_E2E_KUBECONFIG (the suite is skipped); an error for a path that
        is not a file (e2e was asked for and cannot run)."""
        raw = env.get(ENV_KUBECONFIG)
        if not raw:
            return None
        kubeconfig = Path(raw).expanduser()
        if not kubeconfig.is_file():
            raise HarnessError(f"{ENV_KUBECONFIG}={raw!r} is not a file; point it at a kubeconfig")
        port = env.get(ENV_PORT) or None
        if port is not None and not (port.isdigit() and 0 < int(port) < 65536):
            raise HarnessError(f"{ENV_PORT}={port!r} is not a TCP port (1-65535)")
        kubelet_dir = Path(env.get(ENV_KUBELET_DIR) or "/var/lib/kubelet")
        return cls(
            kubeconfig=kubeconfig,
            host=env.get(ENV_HOST) or None,
            bind=env.get(ENV_BIND) or None,
            port=None if port is None else int(port),
            node=env.get(ENV_NODE) or None,
            kubelet_dir=kubelet_dir,
            # kubelet's device plugin directory is fixed (not under --root-dir); seen from here
            # it is usually beside the PodResources directory (a node's, or kind's mounts).
            device_plugin_dir=Path(
                env.get(ENV_DEVICE_PLUGIN_DIR) or kubelet_dir / "device-plugins"
            ),
            node_dir=Path(env.get(ENV_NODE_DIR) or "/var/lib/fracgpu-e2e"),
            dra_node=env.get(ENV_DRA_NODE) or None,
            cdi_dir=Path(env.get(ENV_CDI_DIR) or "/var/run/cdi"),
            release_node=env.get(ENV_RELEASE_NODE) or None,
            release_image=env.get(ENV_RELEASE_IMAGE) or None,
            scheduler_image=env.get(ENV_SCHEDULER_IMAGE) or None,
        )


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def is_loopback(host: str) -> bool:
    return host == "localhost" or (is_ip(host) and ipaddress.ip_address(host).is_loopback)


def bind_address(host: str, bind: str | None) -> str:
    if bind:
        return bind
    if is_loopback(host):
        return host if is_ip(host) else "127.0.0.1"
    return "::" if is_ip(host) and ipaddress.ip_address(host).version == 6 else "0.0.0.0"


def source_address(destination: str) -> str:
    """The address this machine sends from when it talks to ``destination`` (no packet is sent:
    connecting a UDP socket only asks the kernel for the route)."""
    family = socket.AF_INET6 if ipaddress.ip_address(destination).version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        sock.connect((destination, 443))
        address: str = sock.getsockname()[0]
        return address


async def webhook_host(api: Any) -> str:
    """Where the API server can reach this machine, by default: the address this machine uses
    towards a control-plane node's InternalIP (kind and k3d: the Docker bridge's address on the
    node network; a local control plane: 127.0.0.1), else towards the API server's own host."""
    nodes = (await call_json(api, "GET", NODES.path())).get("items", [])
    control = [
        n
        for n in nodes
        if "node-role.kubernetes.io/control-plane" in n["metadata"].get("labels", {})
    ]
    for node in control or nodes:
        for address in node.get("status", {}).get("addresses", []):
            if address.get("type") == "InternalIP" and is_ip(address.get("address", "")):
                return source_address(address["address"])
    server_host = urllib.parse.urlsplit(api.configuration.host).hostname or "127.0.0.1"
    if server_host in ("0.0.0.0", "::"):
        server_host = "127.0.0.1"
    destination = server_host if is_ip(server_host) else socket.gethostbyname(server_host)
    return source_address(destination)


# --- a client usable from synchronous fixtures ----------------------------------------------


class ClusterPortal:
    """One kubernetes-asyncio ApiClient on a loop of its own thread, so synchronous fixtures and
    async tests (each on their own loop) can both drive the cluster through it."""

    def __init__(self, kubeconfig: Path) -> None:
        self.kubeconfig = kubeconfig
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="e2e-portal")
        self._client: contextlib.AbstractAsyncContextManager[Any] | None = None
        self.api: Any = None

    def __enter__(self) -> ClusterPortal:
        self._thread.start()
        try:
            self._client = kube_client(self.kubeconfig)
            self.api = self.run(self._client.__aenter__())
        except BaseException:
            self._stop_loop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self._client is not None:
                self.run(self._client.__aexit__(None, None, None))
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 300) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)


# --- what deploy/ renders to ------------------------------------------------------------------


def kubectl_binary() -> str:
    found = shutil.which("kubectl")
    if found is None:
        raise HarnessError("the e2e suite renders deploy/ and drives the cluster with kubectl; "
                           "put kubectl on PATH")  # fmt: skip
    return found


class Kubectl:
    """kubectl with the run's kubeconfig; returns the completed process, never raises on rc."""

    def __init__(self, kubeconfig: Path, binary: str) -> None:
        self.kubeconfig = kubeconfig
        self.binary = binary

    def __call__(
        self, *args: str, stdin: str | None = None, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [self.binary, "--kubeconfig", str(self.kubeconfig), *args],
            input=stdin,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def ok(self, *args: str, stdin: str | None = None, timeout: float = 60) -> str:
        proc = self(*args, stdin=stdin, timeout=timeout)
        if proc.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed: {proc.stderr.strip()}")
        return proc.stdout

    def get(self, kind: str, name: str, namespace: str) -> Obj:
        data: Obj = json.loads(self.ok("get", kind, name, "-n", namespace, "-o", "json"))
        return data

    def fracgpu(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """``kubectl fracgpu ARGS``: kubectl finds the plugin (the ``kubectl-fracgpu`` console
        script of the environment running the tests) on PATH, as it would for a user; kubectl
        passes a plugin only what follows its name, so the kubeconfig goes last."""
        scripts = str(Path(sys.executable).parent)
        env = {**os.environ, "PATH": f"{scripts}{os.pathsep}{os.environ.get('PATH', '')}"}
        return subprocess.run(
            [self.binary, "fracgpu", *args, "--kubeconfig", str(self.kubeconfig)],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            env=env,
        )


def render(directory: Path) -> list[Obj]:
    """The objects a kustomization renders to, with the renderer users run."""
    proc = subprocess.run(
        [kubectl_binary(), "kustomize", str(directory)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if proc.returncode != 0:
        raise HarnessError(f"kubectl kustomize {directory} failed: {proc.stderr.strip()}")
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


def crds() -> list[Obj]:
    return [o for o in render(DEPLOY / "crds") if o["kind"] == "CustomResourceDefinition"]


def device_classes() -> list[Obj]:
    """The DeviceClass every fracgpu claim names, as deploy/overlays/dra renders it."""
    return [o for o in render(DEPLOY / "overlays" / "dra") if o["kind"] == "DeviceClass"]


def webhook_rbac(admission: Obj, run_id: str) -> list[Obj]:
    """The webhook's ServiceAccount, roles and bindings, as the overlay of its mode renders them
    (DRA mode's adds claim templates, claims and slices), renamed for the run as its webhook
    configurations are, so that runs, and the Helm scenario's release, never share one."""
    overlay = "dra" if admission.get("allocation") == "dra" else "default"
    objs = [
        o
        for o in render(DEPLOY / "overlays" / overlay)
        if o["kind"] in _IDENTITY and o["metadata"]["name"].startswith(WEBHOOK_ACCOUNT)
    ]

    def renamed(name: str) -> str:
        return f"{name}-e2e-{run_id}"

    for obj in objs:
        obj["metadata"]["name"] = renamed(obj["metadata"]["name"])
        obj["metadata"].setdefault("labels", {})[RUN_LABEL] = run_id
        if "roleRef" in obj:
            obj["roleRef"]["name"] = renamed(obj["roleRef"]["name"])
        for subject in obj.get("subjects") or []:
            if subject.get("kind") == "ServiceAccount":
                subject["name"] = renamed(subject["name"])
    return objs


def webhook_configurations() -> list[Obj]:
    """The two webhook configurations exactly as deploy/overlays/default renders them."""
    return [o for o in render(DEPLOY / "overlays" / "default") if o["kind"] in _CONFIGURATIONS]


# --- the GPUQuota CRD -------------------------------------------------------------------------


def _established(crd: Obj) -> bool:
    conditions = (crd.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Established" and c.get("status") == "True" for c in conditions)


async def install_crds(api: Any, objs: list[Obj], *, within_s: float = 60) -> list[str]:
    """Create the CRDs the cluster lacks and wait until every one is served; the names of those
    created here (only they are deleted afterwards: a CRD that was there stays, with its data)."""
    created: list[str] = []
    try:
        for obj in objs:
            name = obj["metadata"]["name"]
            try:
                await call_json(api, "POST", CRDS.path(), body=obj)
            except KubeConflict:
                log.info("CRD already installed; using it as it is", extra={"crd": name})
                continue
            except KubeInvalid as err:
                raise HarnessError(
                    f"the API server refused CustomResourceDefinition {name} from deploy/crds: "
                    f"{err.message}"
                ) from None
            created.append(name)
        deadline = time.monotonic() + within_s
        for obj in objs:
            name = obj["metadata"]["name"]
            while not _established(await call_json(api, "GET", CRDS.path(name=name))):
                if time.monotonic() > deadline:
                    raise HarnessError(f"CustomResourceDefinition {name} was not Established "
                                       f"within {within_s:g}s")  # fmt: skip
                await asyncio.sleep(0.2)
    except BaseException:
        await remove_crds(api, created)
        raise
    return created


async def remove_crds(api: Any, names: list[str]) -> None:
    for name in names:
        with contextlib.suppress(KubeNotFound):
            await call_json(api, "DELETE", CRDS.path(name=name))


async def install_device_classes(api: Any, objs: list[Obj]) -> list[str]:
    """Create the DeviceClasses the cluster lacks; the names of those created here (a class
    that was there, from an installed DRA mode or another run, stays afterwards)."""
    created: list[str] = []
    for obj in objs:
        name = obj["metadata"]["name"]
        try:
            await call_json(api, "POST", DEVICE_CLASSES.path(), body=obj)
        except KubeConflict:
            log.info("DeviceClass already there; using it as it is", extra={"class": name})
            continue
        except KubeNotFound:
            raise HarnessError(
                "the API server does not serve resource.k8s.io/v1 DeviceClasses: DRA mode needs "
                "Kubernetes 1.36 or later"
            ) from None
        created.append(name)
    return created


async def remove_device_classes(api: Any, names: list[str]) -> None:
    for name in names:
        with contextlib.suppress(KubeNotFound):
            await call_json(api, "DELETE", DEVICE_CLASSES.path(name=name))


# --- the local webhook ------------------------------------------------------------------------


def free_port(bind: str) -> int:
    family = socket.AF_INET6 if ":" in bind else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((bind, 0))
        port: int = sock.getsockname()[1]
        return port


def issue_certificates(directory: Path, host: str) -> tuple[Path, Path, Path]:
    """A throwaway CA and a serving certificate for ``host`` (the project's own issuance);
    returns the (cert, key, ca) paths."""
    now = datetime.datetime.now(datetime.UTC)
    backdate = datetime.timedelta(hours=1)
    ca = issue_ca(
        common_name="fracgpu e2e CA",
        lifetime=datetime.timedelta(days=1),
        now=now,
        backdate=backdate,
        algorithm="ecdsa-p256",
    )
    hosts, ips = ([], [host]) if is_ip(host) else ([host], [])
    serving = issue_serving(
        ca,
        hosts=hosts,
        ips=ips,
        lifetime=datetime.timedelta(hours=12),
        now=now,
        backdate=backdate,
        algorithm="ecdsa-p256",
    )
    directory.mkdir(parents=True, exist_ok=True)
    paths = directory / "tls.crt", directory / "tls.key", directory / "ca.crt"
    paths[0].write_bytes(serving.cert_pem())
    paths[1].write_bytes(serving.key_pem())
    paths[1].chmod(0o600)
    paths[2].write_bytes(ca.cert_pem())
    return paths


def fracgpu_command() -> list[str]:
    """The console script of the environment running the tests."""
    script = Path(sys.executable).parent / "fracgpu"
    if script.exists():
        return [str(script)]
    found = shutil.which("fracgpu")
    if found:
        return [found]
    return [sys.executable, "-m", "fracgpu.cli"]


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


class LocalWebhook:
    """``fracgpu serve`` on this machine, stoppable and restartable on the same address."""

    def __init__(
        self,
        workdir: Path,
        host: str,
        bind: str,
        kubeconfig: Path | str,
        port: int | None = None,
        *,
        admission: Obj = ADMISSION,
        run_id: str = "local",
    ) -> None:
        self.host, self.bind = host, bind
        self.port = port or free_port(bind)
        cert, key, ca = issue_certificates(workdir / "tls", host)
        self.ca_pem = ca.read_bytes()
        self.config_path = workdir / "config.yaml"
        self.config: Obj = {
            "server": {"host": bind, "port": self.port},
            "admission": admission,
            "certs": {
                "mode": "files",
                "cert_file": str(cert),
                "key_file": str(key),
                "ca_file": str(ca),
                "inject": False,
            },
            "quota": quota_config(run_id),
            "kubeconfig": str(kubeconfig),
            "shutdown_delay_seconds": 0,
        }
        self.config_path.write_text(yaml.safe_dump(self.config))
        self.log_path = workdir / "serve.log"
        self.process: subprocess.Popen[bytes] | None = None

    def url(self, path: str) -> str:
        return f"https://{_url_host(self.host)}:{self.port}{path}"

    def local_url(self, path: str) -> str:
        """The same endpoint as dialled from this machine (a wildcard bind answers on loopback)."""
        host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(self.bind, self.bind)
        return f"https://{_url_host(host)}:{self.port}{path}"

    def start(self, timeout: float = 60) -> None:
        if self.process is not None:
            return
        with self.log_path.open("ab") as log_file:
            self.process = subprocess.Popen(
                [*fracgpu_command(), "serve", "--config", str(self.config_path)],
                stdout=log_file,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        context = ssl.create_default_context(cadata=self.ca_pem.decode())
        context.check_hostname = False  # dialled on the bind address; the API server checks names
        ready = self.local_url(server.READY_PATH)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                status = self.process.returncode
                self.process = None
                raise HarnessError(f"fracgpu serve exited with {status}:\n{self.log()}")
            with (
                contextlib.suppress(OSError, urllib.error.URLError),
                urllib.request.urlopen(ready, context=context, timeout=2) as reply,
            ):
                if reply.status == 200:
                    return
            time.sleep(0.3)
        self.stop()
        raise HarnessError(f"fracgpu serve was not ready within {timeout:g}s:\n{self.log()}")

    def stop(self) -> None:
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=5)
        self.process = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path.exists() else ""


# --- webhook configurations -----------------------------------------------------------------


def for_local_webhook(objs: list[Obj], run_id: str, webhook: LocalWebhook) -> list[Obj]:
    """The deployed configurations, pointed at the local webhook by URL with its CA, renamed for
    this run, and scoped to this run's namespaces. Rules, matchConditions, timeouts and failure
    policy stay exactly as deployed: they are what the suite tests."""
    ca_bundle = base64.b64encode(webhook.ca_pem).decode()
    out = []
    for original in objs:
        obj = json.loads(json.dumps(original))
        obj["metadata"]["name"] = f"{obj['metadata']['name']}-e2e-{run_id}"
        obj["metadata"].setdefault("labels", {})[RUN_LABEL] = run_id
        for hook in obj["webhooks"]:
            path = hook["clientConfig"]["service"]["path"]
            hook["clientConfig"] = {"url": webhook.url(path), "caBundle": ca_bundle}
            hook["namespaceSelector"] = {"matchLabels": {RUN_LABEL: run_id}}
        out.append(obj)
    return out


async def foreign_registrations(api: Any, objs: list[Obj]) -> list[str]:
    """Configurations outside any e2e run that register the same webhooks (an installed
    fracgpu): they would admit the run's pods too, and the scenarios would see both."""
    found = []
    for kind, resource in _CONFIGURATIONS.items():
        names = {h["name"] for o in objs if o["kind"] == kind for h in o["webhooks"]}
        for other in (await call_json(api, "GET", resource.path())).get("items", []):
            if RUN_LABEL in (other["metadata"].get("labels") or {}):
                continue  # another run's: it selects only that run's namespaces
            if names & {h.get("name") for h in other.get("webhooks") or []}:
                found.append(f"{kind} {other['metadata']['name']}")
    return found


async def register(api: Any, objs: list[Obj]) -> None:
    foreign = await foreign_registrations(api, objs)
    if foreign:
        raise HarnessError(
            f"the cluster already registers fracgpu's webhooks ({', '.join(foreign)}): they "
            f"would admit the e2e run's pods too; run the suite on a cluster without fracgpu "
            f"installed (docs/install.md, Uninstall)"
        )
    for obj in objs:
        await call_json(api, "POST", _CONFIGURATIONS[obj["kind"]].path(), body=obj)


async def unregister(api: Any, objs: list[Obj]) -> None:
    for obj in objs:
        with contextlib.suppress(KubeNotFound):
            path = _CONFIGURATIONS[obj["kind"]].path(name=obj["metadata"]["name"])
            await call_json(api, "DELETE", path)


# --- the webhook's identity ---------------------------------------------------------------


_RBAC = "rbac.authorization.k8s.io"
_IDENTITY = {
    "ServiceAccount": Resource("", "v1", "serviceaccounts", namespaced=True),
    "ClusterRole": Resource(_RBAC, "v1", "clusterroles", namespaced=False),
    "ClusterRoleBinding": Resource(_RBAC, "v1", "clusterrolebindings", namespaced=False),
    "Role": Resource(_RBAC, "v1", "roles", namespaced=True),
    "RoleBinding": Resource(_RBAC, "v1", "rolebindings", namespaced=True),
}


def _rbac_path(obj: Obj, name: str | None = None) -> str:
    resource = _IDENTITY[obj["kind"]]
    namespace = obj["metadata"].get("namespace") if resource.namespaced else None
    return resource.path(namespace, name)


async def install_webhook_identity(api: Any, objs: list[Obj]) -> list[Obj]:
    """The webhook's namespace (when missing) and the run's RBAC objects. Returns what this run
    made, to remove."""
    made: list[Obj] = []
    path = NAMESPACES.path(name=WEBHOOK_NAMESPACE)
    try:
        # The run before may have removed it just now: nothing can be made in it until it is gone.
        for _ in range(600):
            found = await call_json(api, "GET", path)
            if (found.get("status") or {}).get("phase") != "Terminating":
                break
            await asyncio.sleep(0.1)
        else:
            raise HarnessError(f"namespace {WEBHOOK_NAMESPACE} stayed Terminating for 60 s")
    except KubeNotFound:
        namespace = {"apiVersion": "v1", "kind": "Namespace"}
        namespace["metadata"] = {"name": WEBHOOK_NAMESPACE, "labels": {E2E_LABEL: "true"}}
        await call_json(api, "POST", NAMESPACES.path(), body=namespace)
        made.append(namespace)
    for obj in objs:
        await call_json(api, "POST", _rbac_path(obj), body=obj)
        made.append(obj)
    return made


async def remove_webhook_identity(api: Any, made: list[Obj]) -> None:
    """What :func:`install_webhook_identity` made; the namespace only once no other run's
    ServiceAccount is in it (runs of one session overlap)."""
    accounts = f"/api/v1/namespaces/{WEBHOOK_NAMESPACE}/serviceaccounts"
    for obj in reversed(made):  # the namespace, if made, last
        with contextlib.suppress(KubeNotFound):
            if obj["kind"] != "Namespace":
                await call_json(api, "DELETE", _rbac_path(obj, obj["metadata"]["name"]))
            elif not (await call_json(api, "GET", accounts, query=_of_any_run())).get("items"):
                await call_json(api, "DELETE", NAMESPACES.path(name=WEBHOOK_NAMESPACE))


async def webhook_token(api: Any, account: str) -> str:
    """A token the API server issues for the run's webhook ServiceAccount (TokenRequest), valid
    for longer than a run."""
    request = {
        "apiVersion": "authentication.k8s.io/v1",
        "kind": "TokenRequest",
        "spec": {"expirationSeconds": 6 * 3600},
    }
    path = f"/api/v1/namespaces/{WEBHOOK_NAMESPACE}/serviceaccounts/{account}/token"
    granted = await call_json(api, "POST", path, body=request)
    return str(granted["status"]["token"])


def token_kubeconfig(admin: Path, account: str, token: str, path: Path) -> Path:
    """A kubeconfig with the cluster of ``admin``'s current context and, as its user, the
    ServiceAccount ``account`` of the webhook's namespace with ``token``."""
    config = yaml.safe_load(admin.read_text())
    current = config.get("current-context")
    context = next(c for c in config["contexts"] if c["name"] == current)["context"]
    cluster = next(c for c in config["clusters"] if c["name"] == context["cluster"])
    user = f"system:serviceaccount:{WEBHOOK_NAMESPACE}:{account}"
    document = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [cluster],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": "webhook", "context": {"cluster": cluster["name"], "user": user}}],
        "current-context": "webhook",
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(document))
    path.chmod(0o600)
    return path


# --- namespaces -------------------------------------------------------------------------------


async def create_namespace(api: Any, name: str, labels: Mapping[str, str]) -> None:
    body = {
        "apiVersion": "v1",
        "kind": "Namespace",
        # Privileged Pod Security, whatever the cluster's default: the scenarios' pods are
        # about GPUs, not about security contexts.
        "metadata": {
            "name": name,
            "labels": {
                **labels,
                E2E_LABEL: "true",
                "pod-security.kubernetes.io/enforce": "privileged",
            },
        },
    }
    await call_json(api, "POST", NAMESPACES.path(), body=body)


async def delete_namespace(api: Any, name: str) -> None:
    with contextlib.suppress(KubeNotFound):
        await call_json(api, "DELETE", NAMESPACES.path(name=name))


async def delete_lease(api: Any, run_id: str) -> None:
    """The run's quota controller Lease (its replica released it when it stopped)."""
    with contextlib.suppress(KubeNotFound):
        await call_json(api, "DELETE", LEASES.path(LEASE_NAMESPACE, lease_name(run_id)))


def _of_run(run_id: str) -> list[tuple[str, str]]:
    return [("labelSelector", f"{RUN_LABEL}={run_id}")]


def _of_any_run() -> list[tuple[str, str]]:
    return [("labelSelector", RUN_LABEL)]


async def delete_run_namespaces(api: Any, run_id: str) -> None:
    """Every namespace of the run, also those a failed test could not delete itself."""
    listed = await call_json(api, "GET", NAMESPACES.path(), query=_of_run(run_id))
    for item in listed.get("items", []):
        await delete_namespace(api, item["metadata"]["name"])


async def wait_until_admission_effective(
    api: Any, namespace: str, pod: Obj, *, within_s: float = 60
) -> None:
    """The API server loads new webhook configurations asynchronously. In ``namespace``, under a
    GPUQuota of 0.1 card, dry-run ``pod`` (a bigger GPU pod) until the quota webhook denies it:
    it sees the pod only after the mutating webhook made it valid, so both are in effect."""
    quota = {
        "apiVersion": f"{GPUQUOTAS.group}/{GPUQUOTAS.version}",
        "kind": "GPUQuota",
        "metadata": {"name": "e2e-probe"},
        "spec": {"gpu": "0.1"},
    }
    await call_json(api, "POST", GPUQUOTAS.path(namespace), body=quota)
    deadline = time.monotonic() + within_s
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            await call_json(api, "POST", PODS.path(namespace), body=pod, query=[("dryRun", "All")])
            last = "the dry run was admitted (the quota webhook is not in effect yet)"
        except KubeError as err:
            # "exceeded", or in DRA mode "cannot count" (a dry run creates no claim template
            # for the quota to read): either way the quota webhook saw a mutated pod.
            if "denied the request: GPU quota " in err.message:
                return
            last = err.message
        await asyncio.sleep(0.5)
    raise HarnessError(f"the webhook configurations did not take effect within {within_s:g}s: "
                       f"{last}")  # fmt: skip


# --- the run ----------------------------------------------------------------------------------


@dataclass
class Run:
    settings: Settings
    run_id: str
    portal: ClusterPortal
    webhook: LocalWebhook
    configurations: list[Obj]
    installed_crds: list[str]
    namespaces: list[str] = field(default_factory=list)

    @property
    def api(self) -> Any:
        return self.portal.api

    def namespace(self, suffix: str) -> str:
        name = f"fracgpu-e2e-{self.run_id}-{suffix}"
        self.portal.run(create_namespace(self.api, name, {RUN_LABEL: self.run_id}))
        self.namespaces.append(name)
        return name


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """SIGTERM (a CI timeout, `timeout`) raises KeyboardInterrupt, as Ctrl-C does: pytest then
    tears the session's fixtures down, and with them the run, instead of dying at once."""
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def e2e_run(
    settings: Settings,
    workdir: Path,
    run_id: str,
    *,
    admission: Obj = ADMISSION,
    port_offset: int = 0,
) -> Iterator[Run]:
    """Set the run up; on the way out (also after a failure anywhere, setup included) remove
    the webhook configurations, stop the webhook, delete the run's namespaces, the DeviceClass
    and the CRDs this run installed, in that order: nothing is left waiting on a webhook that is
    gone. With ``admission`` in DRA mode the webhook makes claims, which name the DeviceClass of
    deploy/overlays/dra: it is installed too unless the cluster has it. A fixed port
    (FRACGPU_E2E_WEBHOOK_PORT) is listened on plus ``port_offset``, so that a second run of the
    same session (the DRA scenarios') has a port of its own."""
    crd_objs, configurations = crds(), webhook_configurations()
    classes = device_classes() if admission.get("allocation") == "dra" else []
    with contextlib.ExitStack() as stack:
        portal = stack.enter_context(ClusterPortal(settings.kubeconfig))
        installed = portal.run(install_crds(portal.api, crd_objs))
        stack.callback(lambda: portal.run(remove_crds(portal.api, installed)))
        made_classes = portal.run(install_device_classes(portal.api, classes))
        stack.callback(lambda: portal.run(remove_device_classes(portal.api, made_classes)))
        stack.callback(lambda: portal.run(delete_run_namespaces(portal.api, run_id)))
        rbac = webhook_rbac(admission, run_id)
        identity = portal.run(install_webhook_identity(portal.api, rbac))
        stack.callback(lambda: portal.run(remove_webhook_identity(portal.api, identity)))
        (account,) = [o["metadata"]["name"] for o in rbac if o["kind"] == "ServiceAccount"]
        token = portal.run(webhook_token(portal.api, account))
        kubeconfig = token_kubeconfig(
            settings.kubeconfig, account, token, workdir / "webhook.kubeconfig"
        )
        host = settings.host or portal.run(webhook_host(portal.api))
        webhook = LocalWebhook(
            workdir,
            host,
            bind_address(host, settings.bind),
            kubeconfig,
            None if settings.port is None else settings.port + port_offset,
            admission=admission,
            run_id=run_id,
        )
        stack.callback(lambda: portal.run(delete_lease(portal.api, run_id)))
        stack.callback(webhook.stop)
        webhook.start()
        objs = for_local_webhook(configurations, run_id, webhook)
        stack.callback(lambda: portal.run(unregister(portal.api, objs)))
        portal.run(register(portal.api, objs))
        log.info("e2e run ready", extra={"run": run_id, "webhook": webhook.url("")})
        yield Run(settings, run_id, portal, webhook, objs, installed)


async def leftovers(api: Any, run_id: str) -> list[str]:
    """What of the run is still in the cluster (namespaces being deleted count: they go)."""
    found = []
    for resource in (MUTATING_WEBHOOK_CONFIGURATIONS, VALIDATING_WEBHOOK_CONFIGURATIONS):
        listed = await call_json(api, "GET", resource.path(), query=_of_run(run_id))
        found += [f"{resource.plural}/{o['metadata']['name']}" for o in listed.get("items", [])]
    listed = await call_json(api, "GET", NAMESPACES.path(), query=_of_run(run_id))
    found += [
        f"namespaces/{o['metadata']['name']}"
        for o in listed.get("items", [])
        if not o["metadata"].get("deletionTimestamp")
    ]
    with contextlib.suppress(KubeNotFound):
        await call_json(api, "GET", LEASES.path(LEASE_NAMESPACE, lease_name(run_id)))
        found.append(f"leases/{LEASE_NAMESPACE}/{lease_name(run_id)}")
    return found
