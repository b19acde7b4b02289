"""The e2e harness: kubectl against the cluster in FRACGPU_E2E_KUBECONFIG, a test CA, a local
``fracgpu serve`` the API server calls by URL, and webhook configurations made from deploy/.

Nothing here talks to the cluster except through ``kubectl``, so what the tests compare is what a
user sees. See docs/e2e.md for how to point it at kind, k3d or any cluster.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import ipaddress
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from certs.issuance import issue_ca, issue_serving
from webhook import server

ROOT = Path(__file__).resolve().parents[2]
ENV_KUBECONFIG = "FRACGPU_E2E_KUBECONFIG"
# The address the API server uses to reach this machine, and the address to listen on.
ENV_HOST = "FRACGPU_E2E_WEBHOOK_HOST"
ENV_BIND = "FRACGPU_E2E_WEBHOOK_BIND"
# A label that only the test namespaces carry: the test webhook configurations select on it, so
# a run never touches any other namespace of a shared cluster.
RUN_LABEL = "fracgpu.io/e2e-run"
# GPU models the local webhook is told about: an e2e cluster needs no GPU nodes.
MODELS = {"NVIDIA A100-SXM4-80GB": 81920}

Obj = dict[str, Any]


class Kubectl:
    """kubectl with the e2e kubeconfig; returns the completed process, never raises on rc."""

    def __init__(self, kubeconfig: str, binary: str) -> None:
        self.kubeconfig = kubeconfig
        self.binary = binary

    def __call__(
        self, *args: str, stdin: str | None = None, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [self.binary, "--kubeconfig", self.kubeconfig, *args],
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

    def apply(self, objs: list[Obj]) -> None:
        self.ok("apply", "-f", "-", stdin=yaml.safe_dump_all(objs))


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


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
    common = {"now": now, "backdate": datetime.timedelta(hours=1), "algorithm": "ecdsa-p256"}
    ca = issue_ca(common_name="fracgpu e2e CA", lifetime=datetime.timedelta(days=1), **common)
    hosts, ips = ([], [host]) if is_ip(host) else ([host], [])
    serving = issue_serving(
        ca, hosts=hosts, ips=ips, lifetime=datetime.timedelta(hours=12), **common
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


class LocalWebhook:
    """``fracgpu serve`` on this machine, stoppable and restartable on the same address."""

    def __init__(self, workdir: Path, host: str, bind: str, kubeconfig: str) -> None:
        self.host, self.bind = host, bind
        self.port = free_port(bind)
        cert, key, ca = issue_certificates(workdir / "tls", host)
        self.ca_pem = ca.read_bytes()
        self.config_path = workdir / "config.yaml"
        config = {
            "server": {"host": bind, "port": self.port},
            "admission": {"inventory": {"models": MODELS, "watch_nodes": False}},
            "certs": {
                "mode": "files",
                "cert_file": str(cert),
                "key_file": str(key),
                "ca_file": str(ca),
                "inject": False,
            },
            "kubeconfig": kubeconfig,
            "shutdown_delay_seconds": 0,
        }
        self.config_path.write_text(yaml.safe_dump(config))
        self.log_path = workdir / "core.log"
        self.process: subprocess.Popen[bytes] | None = None

    def url(self, path: str) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"https://{host}:{self.port}{path}"

    def start(self, timeout: float = 30) -> None:
        assert self.process is None
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            [*fracgpu_command(), "serve", "--config", str(self.config_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        log.close()
        context = ssl.create_default_context(cadata=self.ca_pem.decode())
        context.check_hostname = False  # we dial the bind address; the API server checks names
        bind = f"[{self.bind}]" if ":" in self.bind else self.bind
        bind = "127.0.0.1" if self.bind in ("0.0.0.0", "") else bind
        ready = f"https://{bind}:{self.port}{server.READY_PATH}"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(
                    f"fracgpu serve exited with {self.process.returncode}:\n{self.log()}"
                )
            with (
                contextlib.suppress(OSError, urllib.error.URLError),
                urllib.request.urlopen(ready, context=context, timeout=2) as reply,
            ):
                if reply.status == 200:
                    return
            time.sleep(0.3)
        self.stop()
        raise AssertionError(f"fracgpu serve was not ready in {timeout}s:\n{self.log()}")

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


def rendered_webhook_configurations() -> list[Obj]:
    """The two webhook configurations exactly as deploy/overlays/default renders them."""
    out = subprocess.run(
        ["kubectl", "kustomize", str(ROOT / "deploy" / "overlays" / "default")],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    return [
        doc
        for doc in yaml.safe_load_all(out)
        if doc and doc["kind"] in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration")
    ]


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


@contextlib.contextmanager
def registered(kubectl: Kubectl, objs: list[Obj]) -> Iterator[None]:
    kubectl.apply(objs)
    try:
        yield
    finally:
        for obj in objs:
            kubectl("delete", obj["kind"], obj["metadata"]["name"], "--ignore-not-found")
