"""Offline checks of the e2e harness (tests/e2e/harness.py), as far as a cluster is not needed.

The harness is run whole against the fake API server with the real ``fracgpu serve``: what it
registers is the deployed webhook configuration, valid for Kubernetes 1.36, aimed by URL at the
running webhook with a caBundle that verifies the certificate it serves, and confined to the run's
namespaces; it installs the CRD only when missing and removes everything it made, also when the
run fails. What only a real API server does (calling the webhooks, CEL matchConditions, the
CRD's schema) is the e2e suite's part.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import json
import os
import shutil
import signal
import socket
import ssl
import stat
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import jsonpatch
import kubernetes_validate
import pytest
import yaml

from core.kube import GPUQUOTAS, MUTATING_WEBHOOK_CONFIGURATIONS, VALIDATING_WEBHOOK_CONFIGURATIONS
from core.labels import PRODUCT_LABEL
from core.units import CORE, MEMORY
from fracgpu.serve import ServeConfig
from testkit import cdiruntime
from testkit.apiserver import FakeApiServer
from testkit.drakubelet import ClaimKey, FakeDraKubelet
from testkit.dranode import share_claim
from testkit.draobjects import allocate_claim
from testkit.kinds import Kind
from testkit.kubelet import Container, FakeKubelet, Pod
from tests.deploy_render import kubectl
from tests.e2e import harness
from tests.e2e.harness import (
    ADMISSION,
    ADMISSION_DRA,
    RUN_LABEL,
    HarnessError,
    LocalWebhook,
    Settings,
    bind_address,
    e2e_run,
    for_local_webhook,
    install_crds,
    issue_certificates,
    sigterm_interrupts,
    webhook_host,
)
from tests.e2e.nodeagent import (
    DraAgent,
    NodeAgent,
    consumed,
    fake_cards,
    node_metadata,
    unpublish,
)
from webhook import server
from webhook.config import AdmissionConfig

KUBERNETES = "1.36.0"  # the schema the registrations are validated against
EXAMPLE = harness.ROOT / "examples" / "admissionreview-pod.json"
CRD_KIND = Kind(
    "apiextensions.k8s.io",
    "v1",
    "CustomResourceDefinition",
    "customresourcedefinitions",
    namespaced=False,
    status_subresource=True,
    tracks_generation=True,
)
PATHS = {
    "MutatingWebhookConfiguration": server.MUTATE_PATH,
    "ValidatingWebhookConfiguration": server.VALIDATE_PATH,
}
Obj = dict[str, Any]


# --- settings ---------------------------------------------------------------------------------


def test_without_the_kubeconfig_variable_there_is_no_run() -> None:
    assert Settings.from_env({}) is None


def test_a_kubeconfig_that_is_not_a_file_is_an_error_naming_the_variable(tmp_path: Path) -> None:
    with pytest.raises(HarnessError, match="FRACGPU_E2E_KUBECONFIG="):
        Settings.from_env({"FRACGPU_E2E_KUBECONFIG": str(tmp_path / "absent")})


def test_settings_defaults(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kc"
    kubeconfig.write_text("{}")
    found = Settings.from_env({"FRACGPU_E2E_KUBECONFIG": str(kubeconfig)})
    assert found == Settings(
        kubeconfig=kubeconfig,
        host=None,
        bind=None,
        port=None,
        node=None,
        kubelet_dir=Path("/var/lib/kubelet"),
        device_plugin_dir=Path("/var/lib/kubelet/device-plugins"),
        node_dir=Path("/var/lib/fracgpu-e2e"),
    )


def test_the_device_plugin_directory_follows_the_kubelet_directory(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kc"
    kubeconfig.write_text("{}")
    env = {"FRACGPU_E2E_KUBECONFIG": str(kubeconfig), "FRACGPU_E2E_KUBELET_DIR": "/tmp/k"}
    found = Settings.from_env(env)
    assert found is not None
    assert found.device_plugin_dir == Path("/tmp/k/device-plugins")


def test_settings_from_every_variable(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kc"
    kubeconfig.write_text("{}")
    env = {
        "FRACGPU_E2E_KUBECONFIG": str(kubeconfig),
        "FRACGPU_E2E_WEBHOOK_HOST": "host.k3d.internal",
        "FRACGPU_E2E_WEBHOOK_BIND": "0.0.0.0",
        "FRACGPU_E2E_WEBHOOK_PORT": "9443",
        "FRACGPU_E2E_NODE": "kind-control-plane",
        "FRACGPU_E2E_KUBELET_DIR": "/tmp/kind-kubelet",
        "FRACGPU_E2E_DEVICE_PLUGIN_DIR": "/tmp/kind-plugins",
        "FRACGPU_E2E_NODE_DIR": "/tmp/fracgpu-node",
        "FRACGPU_E2E_DRA_NODE": "kind-worker",
        "FRACGPU_E2E_CDI_DIR": "/tmp/kind-cdi",
    }
    assert Settings.from_env(env) == Settings(
        kubeconfig=kubeconfig,
        host="host.k3d.internal",
        bind="0.0.0.0",
        port=9443,
        node="kind-control-plane",
        kubelet_dir=Path("/tmp/kind-kubelet"),
        device_plugin_dir=Path("/tmp/kind-plugins"),
        node_dir=Path("/tmp/fracgpu-node"),
        dra_node="kind-worker",
        cdi_dir=Path("/tmp/kind-cdi"),
    )


def test_without_the_dra_variable_there_is_no_dra_node(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kc"
    kubeconfig.write_text("{}")
    found = Settings.from_env({"FRACGPU_E2E_KUBECONFIG": str(kubeconfig)})
    assert found is not None
    assert (found.dra_node, found.cdi_dir) == (None, Path("/var/run/cdi"))


@pytest.mark.parametrize("port", ["0", "65536", "https", "-1"])
def test_a_webhook_port_that_is_not_a_port_is_an_error(tmp_path: Path, port: str) -> None:
    kubeconfig = tmp_path / "kc"
    kubeconfig.write_text("{}")
    env = {"FRACGPU_E2E_KUBECONFIG": str(kubeconfig), "FRACGPU_E2E_WEBHOOK_PORT": port}
    with pytest.raises(HarnessError, match="FRACGPU_E2E_WEBHOOK_PORT="):
        Settings.from_env(env)


@pytest.mark.parametrize(
    ("host", "bind", "want"),
    [
        pytest.param("127.0.0.1", None, "127.0.0.1", id="loopback-stays-private"),
        pytest.param("::1", None, "::1", id="ipv6-loopback"),
        pytest.param("localhost", None, "127.0.0.1", id="localhost"),
        pytest.param("172.18.0.1", None, "0.0.0.0", id="kind-bridge"),
        pytest.param("host.k3d.internal", None, "0.0.0.0", id="dns-name"),
        pytest.param("fd00::1", None, "::", id="ipv6"),
        pytest.param("172.18.0.1", "172.18.0.1", "172.18.0.1", id="explicit-bind-wins"),
    ],
)
def test_bind_address(host: str, bind: str | None, want: str) -> None:
    assert bind_address(host, bind) == want


def test_sigterm_interrupts_the_run_like_ctrl_c() -> None:
    """So pytest tears the run down (and cleans the cluster) when a CI timeout terminates it."""
    with pytest.raises(KeyboardInterrupt), sigterm_interrupts():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler runs at the next bytecode; never reached


def test_sigterm_is_itself_again_after_the_run() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with sigterm_interrupts():
        pass
    assert signal.getsignal(signal.SIGTERM) is before


# --- the address the API server dials ---------------------------------------------------------


@pytest.fixture
async def fake() -> AsyncIterator[FakeApiServer]:
    async with FakeApiServer() as server_:
        server_.register(CRD_KIND)
        establisher = asyncio.create_task(_establish_crds(server_))
        try:
            yield server_
        finally:
            establisher.cancel()
            await asyncio.gather(establisher, return_exceptions=True)


async def _establish_crds(fake: FakeApiServer) -> None:
    """What the real API server's CRD controller does: mark each new CRD Established."""
    while True:
        for crd in fake.objects(CRD_KIND.plural):
            if not (crd.get("status") or {}).get("conditions"):
                crd["status"] = {"conditions": [{"type": "Established", "status": "True"}]}
                fake.put(crd)
        await asyncio.sleep(0.02)


def _node(name: str, address: str, *, control_plane: bool) -> Obj:
    labels = {"node-role.kubernetes.io/control-plane": ""} if control_plane else {}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": labels},
        "status": {"addresses": [{"type": "InternalIP", "address": address}]},
    }


async def test_webhook_host_is_this_machines_address_towards_the_control_plane(
    fake: FakeApiServer,
) -> None:
    fake.put(_node("worker", "192.0.2.10", control_plane=False))
    fake.put(_node("control", "127.0.0.1", control_plane=True))
    async with fake.api_client() as api:
        assert await webhook_host(api) == "127.0.0.1"


async def test_webhook_host_without_nodes_is_towards_the_api_server(fake: FakeApiServer) -> None:
    async with fake.api_client() as api:
        assert await webhook_host(api) == "127.0.0.1"


# --- the registration -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def deployed() -> list[Obj]:
    kubectl()
    return harness.webhook_configurations()


def _without(hook: Obj, *keys: str) -> Obj:
    return {k: v for k, v in hook.items() if k not in keys}


def _registration(tmp_path: Path, deployed: list[Obj], host: str) -> tuple[LocalWebhook, list[Obj]]:
    local = LocalWebhook(tmp_path, host, "127.0.0.1", "/nonexistent/kubeconfig")
    return local, for_local_webhook(deployed, "abc123", local)


HOSTS = [pytest.param("127.0.0.1", id="ip"), pytest.param("host.k3d.internal", id="dns-name")]


def test_both_webhook_configurations_are_registered(tmp_path: Path, deployed: list[Obj]) -> None:
    _, objs = _registration(tmp_path, deployed, "127.0.0.1")
    assert sorted(o["kind"] for o in objs) == sorted(PATHS)


@pytest.mark.parametrize("host", HOSTS)
def test_registration_is_valid_for_kubernetes_1_36(
    tmp_path: Path, deployed: list[Obj], host: str
) -> None:
    _, objs = _registration(tmp_path, deployed, host)
    for obj in objs:
        kubernetes_validate.validate(obj, KUBERNETES, strict=True)


@pytest.mark.parametrize("host", HOSTS)
def test_registration_urls_are_what_the_api_server_accepts(
    tmp_path: Path, deployed: list[Obj], host: str
) -> None:
    """The rules the API server checks beyond the schema: https, no user, query or fragment."""
    local, objs = _registration(tmp_path, deployed, host)
    for obj in objs:
        (hook,) = obj["webhooks"]
        url = urllib.parse.urlsplit(hook["clientConfig"]["url"])
        assert (url.scheme, url.hostname, url.port) == ("https", host, local.port)
        assert (url.username, url.query, url.fragment) == (None, "", "")
        assert url.path == PATHS[obj["kind"]]
        assert "service" not in hook["clientConfig"]


@pytest.mark.parametrize("host", HOSTS)
def test_registration_trusts_exactly_the_local_ca(
    tmp_path: Path, deployed: list[Obj], host: str
) -> None:
    local, objs = _registration(tmp_path, deployed, host)
    for obj in objs:
        (hook,) = obj["webhooks"]
        assert base64.b64decode(hook["clientConfig"]["caBundle"]) == local.ca_pem


def test_registration_is_confined_to_the_runs_namespaces(
    tmp_path: Path, deployed: list[Obj]
) -> None:
    _, objs = _registration(tmp_path, deployed, "127.0.0.1")
    for obj in objs:
        (hook,) = obj["webhooks"]
        assert hook["namespaceSelector"] == {"matchLabels": {RUN_LABEL: "abc123"}}


def test_registration_keeps_everything_else_as_deployed(
    tmp_path: Path, deployed: list[Obj]
) -> None:
    """Rules, matchConditions, failure policy, timeouts, side effects, review versions and
    reinvocation are what the suite tests, so none of them may differ from deploy/."""
    _, objs = _registration(tmp_path, deployed, "127.0.0.1")
    for obj, original in zip(objs, deployed, strict=True):
        kept = [_without(h, "clientConfig", "namespaceSelector") for h in obj["webhooks"]]
        assert kept == [
            _without(h, "clientConfig", "namespaceSelector") for h in original["webhooks"]
        ]


def test_registration_is_named_and_labelled_for_the_run(
    tmp_path: Path, deployed: list[Obj]
) -> None:
    _, objs = _registration(tmp_path, deployed, "127.0.0.1")
    names = [o["metadata"]["name"] for o in objs]
    assert names == [f"{o['metadata']['name']}-e2e-abc123" for o in deployed]
    assert [o["metadata"]["labels"][RUN_LABEL] for o in objs] == ["abc123", "abc123"]


def test_the_deployed_configurations_are_left_unchanged(
    tmp_path: Path, deployed: list[Obj]
) -> None:
    before = copy.deepcopy(deployed)
    _registration(tmp_path, deployed, "127.0.0.1")
    assert deployed == before


# --- the local webhook's configuration and certificate ----------------------------------------


def test_local_webhook_config_is_one_serve_accepts(tmp_path: Path) -> None:
    local = LocalWebhook(tmp_path, "127.0.0.1", "127.0.0.1", "/nonexistent/kubeconfig")
    config = ServeConfig.model_validate(yaml.safe_load(local.config_path.read_text()))
    assert (config.server.host, config.server.port) == ("127.0.0.1", local.port)


def test_a_fixed_port_is_listened_on_and_registered(tmp_path: Path, deployed: list[Obj]) -> None:
    local = LocalWebhook(tmp_path, "127.0.0.1", "127.0.0.1", "/nonexistent/kubeconfig", 9443)
    config = ServeConfig.model_validate(yaml.safe_load(local.config_path.read_text()))
    urls = [
        h["clientConfig"]["url"]
        for o in for_local_webhook(deployed, "x", local)
        for h in o["webhooks"]
    ]
    assert config.server.port == 9443
    assert [urllib.parse.urlsplit(u).port for u in urls] == [9443, 9443]


def test_local_webhook_is_given_the_admission_the_scenarios_expect(tmp_path: Path) -> None:
    """The scenarios compute their expectations from ADMISSION; serve must run exactly that."""
    local = LocalWebhook(tmp_path, "127.0.0.1", "127.0.0.1", "/nonexistent/kubeconfig")
    config = ServeConfig.model_validate(yaml.safe_load(local.config_path.read_text()))
    assert config.admission == AdmissionConfig.model_validate(ADMISSION)


def test_the_dra_webhook_is_given_the_same_admission_in_dra_mode(tmp_path: Path) -> None:
    """The DRA scenarios' webhook: what the others get, but claims instead of extended
    resources."""
    local = LocalWebhook(
        tmp_path, "127.0.0.1", "127.0.0.1", "/nonexistent/kubeconfig", admission=ADMISSION_DRA
    )
    config = ServeConfig.model_validate(yaml.safe_load(local.config_path.read_text()))
    assert config.admission == AdmissionConfig.model_validate(ADMISSION).model_copy(
        update={"allocation": "dra"}
    )


def test_local_webhook_leads_a_lease_of_its_run(tmp_path: Path) -> None:
    """Each run's replica elects itself on a Lease named for the run, in a namespace every
    cluster has: two runs on one cluster never share a leader, and a test can take it away."""
    local = LocalWebhook(
        tmp_path, "127.0.0.1", "127.0.0.1", "/nonexistent/kubeconfig", run_id="abc123"
    )
    config = ServeConfig.model_validate(yaml.safe_load(local.config_path.read_text()))
    election = config.quota.leader_election
    assert election.enabled
    assert (election.namespace(), election.lease_name) == ("fracgpu", "fracgpu-e2e-abc123-quota")


def test_local_webhook_answers_in_time_for_the_deployed_timeout(
    tmp_path: Path, deployed: list[Obj]
) -> None:
    """A quota decision must end before the API server gives up on the call."""
    local = LocalWebhook(tmp_path, "127.0.0.1", "127.0.0.1", "/nonexistent/kubeconfig")
    config = ServeConfig.model_validate(yaml.safe_load(local.config_path.read_text()))
    timeouts = [h.get("timeoutSeconds", 10) for o in deployed for h in o["webhooks"]]
    assert config.quota.timeout_s < min(timeouts)


def _handshake(cert: Path, key: Path, ca: bytes, server_hostname: str) -> None:
    """A TLS handshake in memory; raises ssl.SSLCertVerificationError if the client rejects."""
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)
    client_ctx = ssl.create_default_context(cadata=ca.decode())
    c_in, c_out, s_in, s_out = (ssl.MemoryBIO() for _ in range(4))
    client = client_ctx.wrap_bio(c_in, c_out, server_hostname=server_hostname)
    srv = server_ctx.wrap_bio(s_in, s_out, server_side=True)
    for _ in range(10):
        for side in (client, srv):
            with contextlib.suppress(ssl.SSLWantReadError):
                side.do_handshake()
        s_in.write(c_out.read())
        c_in.write(s_out.read())
    client.do_handshake()


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "localhost", "host.k3d.internal"])
def test_certificates_verify_for_the_dialled_host(tmp_path: Path, host: str) -> None:
    cert, key, ca = issue_certificates(tmp_path, host)
    _handshake(cert, key, ca.read_bytes(), host)


@pytest.mark.parametrize("host", ["127.0.0.1", "host.k3d.internal"])
def test_certificates_do_not_verify_for_another_host(tmp_path: Path, host: str) -> None:
    cert, key, ca = issue_certificates(tmp_path, host)
    with pytest.raises(ssl.SSLCertVerificationError):
        _handshake(cert, key, ca.read_bytes(), "example.org")


def test_the_private_key_is_readable_by_its_owner_only(tmp_path: Path) -> None:
    _, key, _ = issue_certificates(tmp_path, "127.0.0.1")
    assert key.stat().st_mode & 0o077 == 0


# --- a whole run against the fake API server --------------------------------------------------


def _settings(kubeconfig: Path, **overrides: Any) -> Settings:
    kubectl()  # the run renders deploy/ with it
    fields: dict[str, Any] = {
        "kubeconfig": kubeconfig,
        "host": "127.0.0.1",
        "bind": None,
        "port": None,
        "node": None,
        "kubelet_dir": Path("/var/lib/kubelet"),
        "device_plugin_dir": Path("/var/lib/kubelet/device-plugins"),
        "node_dir": Path("/var/lib/fracgpu-e2e"),
    }
    return Settings(**{**fields, **overrides})


class Background:
    """Runs the harness's blocking ``e2e_run`` in a thread: entered, held open while the test
    looks (from its loop, which serves the fake), and left when told, with what it raised."""

    def __init__(
        self,
        settings: Settings,
        workdir: Path,
        *,
        fail_inside: bool = False,
        admission: Obj = ADMISSION,
        port_offset: int = 0,
    ) -> None:
        self.settings, self.workdir, self.fail_inside = settings, workdir, fail_inside
        self.admission, self.port_offset = admission, port_offset
        self.ready = threading.Event()
        self.leave = threading.Event()
        self.run: harness.Run | None = None
        self.error: BaseException | None = None

    def main(self) -> None:
        try:
            with e2e_run(
                self.settings,
                self.workdir,
                "off1ne",
                admission=self.admission,
                port_offset=self.port_offset,
            ) as run:
                self.run = run
                self.ready.set()
                self.leave.wait(120)
                if self.fail_inside:
                    raise RuntimeError("a scenario failed")
        except BaseException as exc:  # handed to the test, which asserts on it
            self.error = exc
        finally:
            self.ready.set()

    async def __aenter__(self) -> Background:
        self.thread = threading.Thread(target=self.main)
        self.thread.start()
        await asyncio.to_thread(self.ready.wait, 120)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.leave.set()
        await asyncio.to_thread(self.thread.join, 120)


def _quota_fixture(fake: FakeApiServer) -> None:
    """team-a (the example review's namespace) with a GPUQuota of 0.1 card, so the validating
    webhook's answer shows it reads this cluster."""
    fake.put({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "team-a"}})
    fake.put(
        {
            "apiVersion": f"{GPUQUOTAS.group}/{GPUQUOTAS.version}",
            "kind": "GPUQuota",
            "metadata": {"name": "small", "namespace": "team-a"},
            "spec": {"gpu": "0.1"},
        }
    )


def _review(path: str) -> Obj:
    review: Obj = json.loads(EXAMPLE.read_text())
    if path == server.VALIDATE_PATH:  # the validating webhook sees the pod after mutation
        container = review["request"]["object"]["spec"]["containers"][0]
        container["resources"] = {"limits": {"fracgpu.io/core": "50", "fracgpu.io/memory": "48"}}
    return review


def _post_verified(url: str, ca_bundle: bytes, body: Obj) -> Obj:
    """POST as the API server would: TLS verified against the caBundle, for the URL's host."""
    context = ssl.create_default_context(cadata=ca_bundle.decode())
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, context=context, timeout=10) as response:
        data: Obj = json.loads(response.read())
        return data


def _stored_configurations(fake: FakeApiServer) -> list[Obj]:
    return [
        *fake.objects(MUTATING_WEBHOOK_CONFIGURATIONS.plural),
        *fake.objects(VALIDATING_WEBHOOK_CONFIGURATIONS.plural),
    ]


async def test_a_run_installs_the_crd_and_both_webhooks_answer_through_their_registration(
    fake: FakeApiServer, tmp_path: Path
) -> None:
    _quota_fixture(fake)
    settings = _settings(fake.kubeconfig(tmp_path / "kubeconfig"))
    async with Background(settings, tmp_path / "run") as background:
        assert background.error is None, background.error
        installed = [c["metadata"]["name"] for c in fake.objects(CRD_KIND.plural)]
        stored = _stored_configurations(fake)
        answers = {}
        for obj in stored:
            kubernetes_validate.validate(obj, KUBERNETES, strict=True)
            (hook,) = obj["webhooks"]
            path = urllib.parse.urlsplit(hook["clientConfig"]["url"]).path
            review = _review(path)
            ca_bundle = base64.b64decode(hook["clientConfig"]["caBundle"])
            reply = await asyncio.to_thread(
                _post_verified, hook["clientConfig"]["url"], ca_bundle, review
            )
            answers[path] = reply["response"]
    assert installed == [c["metadata"]["name"] for c in harness.crds()]
    assert sorted(answers) == sorted(PATHS.values())
    assert answers[server.MUTATE_PATH]["allowed"] is True
    assert answers[server.MUTATE_PATH]["patchType"] == "JSONPatch"
    assert answers[server.VALIDATE_PATH]["allowed"] is False
    assert "GPU quota exceeded" in answers[server.VALIDATE_PATH]["status"]["message"]


async def test_the_local_webhook_restarts_behind_its_registration(
    fake: FakeApiServer, tmp_path: Path
) -> None:
    """The webhook-down scenario stops and restarts it: the registration must stay valid."""
    settings = _settings(fake.kubeconfig(tmp_path / "kubeconfig"))
    async with Background(settings, tmp_path / "run") as background:
        assert background.run is not None
        webhook = background.run.webhook
        (mutating,) = fake.objects(MUTATING_WEBHOOK_CONFIGURATIONS.plural)
        client = mutating["webhooks"][0]["clientConfig"]
        ca_bundle = base64.b64decode(client["caBundle"])
        await asyncio.to_thread(webhook.stop)
        with pytest.raises(OSError):
            await asyncio.to_thread(_post_verified, client["url"], ca_bundle, _review("/mutate"))
        await asyncio.to_thread(webhook.start)
        reply = await asyncio.to_thread(
            _post_verified, client["url"], ca_bundle, _review(server.MUTATE_PATH)
        )
    assert reply["response"]["allowed"] is True


def _leftovers(fake: FakeApiServer) -> list[str]:
    kinds = (
        MUTATING_WEBHOOK_CONFIGURATIONS.plural,
        VALIDATING_WEBHOOK_CONFIGURATIONS.plural,
        CRD_KIND.plural,
    )
    identity = ("serviceaccounts", "clusterroles", "clusterrolebindings", "roles", "rolebindings")
    found = [f"{k}/{o['metadata']['name']}" for k in kinds + identity for o in fake.objects(k)]
    found += [
        f"namespaces/{o['metadata']['name']}"
        for o in fake.objects("namespaces")
        if RUN_LABEL in (o["metadata"].get("labels") or {})
        or o["metadata"]["name"] == harness.WEBHOOK_NAMESPACE
    ]
    return found


IDENTITY_CASES = {
    "device-plugin mode: the default overlay's": (ADMISSION, False),
    "DRA mode: the dra overlay's, with claims and slices": (ADMISSION_DRA, True),
}


@pytest.mark.parametrize("admission, dra", IDENTITY_CASES.values(), ids=IDENTITY_CASES)
def test_the_webhook_runs_with_the_rbac_deploy_grants_it(admission: Obj, dra: bool) -> None:
    kubectl()  # deploy/ is rendered with it
    objs = harness.webhook_rbac(admission, "abc123")
    names = {(o["kind"], o["metadata"]["name"]) for o in objs}
    assert ("ServiceAccount", "fracgpu-webhook-e2e-abc123") in names
    assert ("ClusterRole", "fracgpu-webhook-e2e-abc123") in names
    assert ("RoleBinding", "fracgpu-webhook-leases-e2e-abc123") in names
    assert (("ClusterRole", "fracgpu-webhook-dra-e2e-abc123") in names) == dra
    # Renamed for the run as a whole: every binding grants the run's roles to the run's account.
    for obj in objs:
        assert obj["metadata"]["labels"][RUN_LABEL] == "abc123"
        if "roleRef" in obj:
            assert (obj["roleRef"]["kind"], obj["roleRef"]["name"]) in names
            (subject,) = obj["subjects"]
            assert subject["name"] == "fracgpu-webhook-e2e-abc123"
    overlay = harness.DEPLOY / "overlays" / ("dra" if dra else "default")
    deployed = {(o["kind"], o["metadata"]["name"]): o for o in harness.render(overlay)}
    for obj in objs:  # the rules are the deployed ones
        original = deployed[obj["kind"], obj["metadata"]["name"].removesuffix("-e2e-abc123")]
        assert obj.get("rules") == original.get("rules")


async def test_a_run_waits_for_the_namespace_the_run_before_is_removing(
    fake: FakeApiServer,
) -> None:
    """Runs of one `make e2e` follow each other: the DRA run starts while the namespace the
    device-plugin run made and removed is still Terminating, where nothing can be made."""
    namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "fracgpu"}}
    fake.put({**namespace, "status": {"phase": "Terminating"}})
    kubectl()
    rbac = harness.webhook_rbac(ADMISSION, "abc123")

    async def finish_termination() -> None:
        await asyncio.sleep(0.5)
        fake.remove("namespaces", "fracgpu")

    async with fake.api_client() as api:
        gone = asyncio.create_task(finish_termination())
        made = await harness.install_webhook_identity(api, rbac)
        await gone
        assert made[0]["kind"] == "Namespace"  # made again once the old one was gone
        assert fake.get("serviceaccounts", "fracgpu-webhook-e2e-abc123", "fracgpu") is not None
        await harness.remove_webhook_identity(api, made)
    assert fake.get("namespaces", "fracgpu") is None


async def test_the_local_webhook_calls_the_api_server_with_its_accounts_token(
    fake: FakeApiServer, tmp_path: Path
) -> None:
    settings = _settings(fake.kubeconfig(tmp_path / "kubeconfig"))
    async with Background(settings, tmp_path / "run") as background:
        assert background.run is not None
        served = background.run.webhook.config["kubeconfig"]
        assert served != str(settings.kubeconfig)
        kubeconfig = yaml.safe_load(await asyncio.to_thread(Path(served).read_text))
        (user,) = kubeconfig["users"]
        assert user["name"] == "system:serviceaccount:fracgpu:fracgpu-webhook-e2e-off1ne"
        assert set(user["user"]) == {"token"}  # no client certificate of the suite's
        assert fake.get("serviceaccounts", "fracgpu-webhook-e2e-off1ne", "fracgpu") is not None
        assert background.run.webhook.config["quota"]["leader_election"]["lease_namespace"] == (
            harness.WEBHOOK_NAMESPACE
        )
    assert background.error is None


@pytest.mark.parametrize("fail_inside", [False, True], ids=["passed", "failed"])
async def test_a_run_removes_everything_it_made(
    fake: FakeApiServer, tmp_path: Path, fail_inside: bool
) -> None:
    settings = _settings(fake.kubeconfig(tmp_path / "kubeconfig"))
    async with Background(settings, tmp_path / "run", fail_inside=fail_inside) as background:
        assert background.run is not None
        namespace = await asyncio.to_thread(background.run.namespace, "one")
        labels = fake.get("namespaces", namespace)["metadata"]["labels"]  # type: ignore[index]
        assert labels["pod-security.kubernetes.io/enforce"] == "privileged"
        assert _leftovers(fake)
        webhook = background.run.webhook
    assert _leftovers(fake) == []
    assert isinstance(background.error, RuntimeError) == fail_inside, "a failure is not swallowed"
    assert webhook.process is None
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", webhook.port), timeout=2):
        pass


async def test_a_run_that_fails_to_set_up_removes_the_crd(
    fake: FakeApiServer, tmp_path: Path
) -> None:
    # An address that is not this machine's: the local webhook cannot listen, after the CRD
    # was installed.
    settings = _settings(fake.kubeconfig(tmp_path / "kubeconfig"), bind="192.0.2.1")
    async with Background(settings, tmp_path / "run") as background:
        assert isinstance(background.error, OSError)
    assert _leftovers(fake) == []


async def test_a_cluster_with_fracgpu_installed_is_refused_and_left_as_it_was(
    fake: FakeApiServer, tmp_path: Path
) -> None:
    (installed,) = [
        o for o in harness.webhook_configurations() if o["kind"] == "MutatingWebhookConfiguration"
    ]
    fake.put(installed)
    settings = _settings(fake.kubeconfig(tmp_path / "kubeconfig"))
    async with Background(settings, tmp_path / "run") as background:
        assert isinstance(background.error, HarnessError)
    assert "MutatingWebhookConfiguration fracgpu-mutate" in str(background.error)
    assert [
        o["metadata"]["name"] for o in fake.objects(MUTATING_WEBHOOK_CONFIGURATIONS.plural)
    ] == ["fracgpu-mutate"]


async def test_another_runs_registration_is_not_in_the_way(
    fake: FakeApiServer, tmp_path: Path, deployed: list[Obj]
) -> None:
    other = LocalWebhook(tmp_path / "other", "127.0.0.1", "127.0.0.1", "/nonexistent/kubeconfig")
    for obj in for_local_webhook(deployed, "0ther1", other):
        fake.put(obj)
    settings = _settings(fake.kubeconfig(tmp_path / "kubeconfig"))
    async with Background(settings, tmp_path / "run") as background:
        assert background.error is None, background.error


async def test_a_crd_that_was_installed_before_is_kept(fake: FakeApiServer, tmp_path: Path) -> None:
    crds = harness.crds()
    for crd in crds:
        fake.put({**crd, "status": {"conditions": [{"type": "Established", "status": "True"}]}})
    settings = _settings(fake.kubeconfig(tmp_path / "kubeconfig"))
    async with Background(settings, tmp_path / "run") as background:
        assert background.error is None, background.error
    assert sorted(c["metadata"]["name"] for c in fake.objects(CRD_KIND.plural)) == sorted(
        crd["metadata"]["name"] for crd in crds
    )


async def test_a_crd_the_api_server_refuses_fails_the_run_with_its_message(
    fake: FakeApiServer,
) -> None:
    crd = harness.crds()[0]
    refused = {**crd, "metadata": {**crd["metadata"], "name": "Not_A_Valid_Name"}}
    async with fake.api_client() as api:
        with pytest.raises(HarnessError, match="refused CustomResourceDefinition Not_A_Valid_Name"):
            await install_crds(api, [refused])


# --- the node agent of the device-plugin scenarios, against the fake kubelet ------------------


@pytest.fixture
def node_root() -> Iterator[Path]:
    """A short directory: unix socket paths must stay under 108 bytes."""
    root = Path(tempfile.mkdtemp(prefix="fge", dir="/tmp"))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _is_char_device(path: str) -> bool:
    return stat.S_ISCHR(os.stat(path).st_mode)  # follows the link, as the runtime resolves it


def _poll(check: Callable[[], bool], within_s: float = 30) -> None:
    deadline = time.monotonic() + within_s
    while not check():
        assert time.monotonic() < deadline, f"not within {within_s:g}s"
        time.sleep(0.1)


def _published(fake: FakeApiServer) -> bool:
    node = fake.get("nodes", "node-a") or {}
    return PRODUCT_LABEL in (node.get("metadata") or {}).get("labels", {})


async def test_the_node_agent_serves_a_kubelet_with_paths_its_runtime_can_use(
    fake: FakeApiServer, tmp_path: Path, node_root: Path
) -> None:
    """The real `fracgpu device-plugin` as the node scenarios run it: registered with kubelet,
    every device and mount it hands to the container runtime exists on the node (the fake
    cards' devices resolve to character devices), the limits file is where the scenarios read
    it, and what it published on the Node is removed again."""
    kubelet_dir = node_root / "kubelet"
    kubelet = FakeKubelet(
        kubelet_dir / "device-plugins", kubelet_dir / "pod-resources" / "kubelet.sock"
    )
    fake.put(_node("node-a", "127.0.0.1", control_plane=False))
    settings = _settings(
        fake.kubeconfig(tmp_path / "kubeconfig"),
        node="node-a",
        kubelet_dir=kubelet_dir,
        device_plugin_dir=kubelet_dir / "device-plugins",
        node_dir=node_root / "node",
    )
    agent = NodeAgent(settings, "off1ne", fake_cards(), tmp_path)
    pod = Pod("e2e", "p", [Container("main", {CORE: 50, MEMORY: 48})])
    async with fake.api_client() as api:
        before = await node_metadata(api, "node-a")
        kubelet.start()
        try:
            agent.prepare()
            limits_before = agent.written()
            agent.start()
            await asyncio.to_thread(_poll, agent.registered)
            capacity = kubelet.capacity(CORE)
            await asyncio.to_thread(kubelet.admit, pod)
            await asyncio.to_thread(kubelet.start_container, pod, "main")
            response = kubelet.responses[pod.key]["main"][CORE]
            devices = [d.host_path for d in response.devices]
            mounts = [m.host_path for m in response.mounts]
            chars = await asyncio.to_thread(lambda: [_is_char_device(p) for p in devices])
            present = await asyncio.to_thread(lambda: [os.path.exists(p) for p in mounts])
            written = await asyncio.to_thread(agent.limits, limits_before)
            await asyncio.to_thread(_poll, lambda: _published(fake))
        finally:
            agent.stop()
            kubelet.stop()
        await unpublish(api, "node-a", before)
        after = await node_metadata(api, "node-a")
    assert capacity == 100 * len(agent.cards)
    assert chars == [True] * len(devices)
    assert present == [True] * len(mounts)
    assert [w.compute_percent for w in written] == [50]
    assert agent.process is None
    assert (after.get("labels") or {}) == (before.get("labels") or {})
    assert (after.get("annotations") or {}) == (before.get("annotations") or {})


# --- the DRA scenarios' run and node agent, against the fake API server and fake kubelet -------


def _free_port_and_next() -> int:
    """A port whose successor is free too, both held at once while looking: the run listens on
    the next one, and a free port alone said nothing of it (CI once found it taken)."""
    for _ in range(100):
        with socket.socket() as first, socket.socket() as second:
            first.bind(("127.0.0.1", 0))
            port: int = first.getsockname()[1]
            try:
                second.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise AssertionError("no two adjacent free ports on 127.0.0.1")


def _device_classes(fake: FakeApiServer) -> list[str]:
    return [c["metadata"]["name"] for c in fake.objects("deviceclasses")]


async def test_a_dra_run_installs_the_device_class_and_removes_it(
    fake: FakeApiServer, tmp_path: Path
) -> None:
    port = _free_port_and_next()
    settings = _settings(fake.kubeconfig(tmp_path / "kubeconfig"), port=port)
    async with Background(
        settings, tmp_path / "run", admission=ADMISSION_DRA, port_offset=1
    ) as background:
        assert background.run is not None, background.error
        during = _device_classes(fake)
        served = background.run.webhook.config["admission"]
        listened = background.run.webhook.port
    assert background.error is None, background.error
    assert during == [c["metadata"]["name"] for c in harness.device_classes()]
    assert served["allocation"] == "dra"
    assert listened == port + 1
    assert _device_classes(fake) == []
    assert _leftovers(fake) == []


async def test_the_dra_probe_pod_is_denied_by_the_quota_after_mutation(
    fake: FakeApiServer, tmp_path: Path
) -> None:
    """The DRA run waits for its webhooks with a whole-card probe (no slice, so no GPU model,
    exists yet): the mutating webhook must turn it into a claim, and the quota webhook must then
    deny it under 0.1 card with a message the wait recognises."""
    _quota_fixture(fake)
    settings = _settings(fake.kubeconfig(tmp_path / "kubeconfig"))
    async with Background(settings, tmp_path / "run", admission=ADMISSION_DRA) as background:
        assert background.run is not None, background.error
        webhook = background.run.webhook
        review = _review(server.MUTATE_PATH)
        review["request"]["dryRun"] = True
        container = review["request"]["object"]["spec"]["containers"][0]
        container["resources"] = {"limits": {"fracgpu.io/gpu": "1"}}
        mutated = await asyncio.to_thread(
            _post_verified, webhook.local_url(server.MUTATE_PATH), webhook.ca_pem, review
        )
        patch = json.loads(base64.b64decode(mutated["response"]["patch"]))
        review["request"]["object"] = jsonpatch.apply_patch(review["request"]["object"], patch)
        validated = await asyncio.to_thread(
            _post_verified, webhook.local_url(server.VALIDATE_PATH), webhook.ca_pem, review
        )
    assert review["request"]["object"]["spec"]["resourceClaims"]
    assert validated["response"]["allowed"] is False
    assert validated["response"]["status"]["message"].startswith("GPU quota ")


async def test_a_device_class_that_was_there_is_kept(fake: FakeApiServer, tmp_path: Path) -> None:
    (device_class,) = harness.device_classes()
    fake.put(device_class)
    settings = _settings(fake.kubeconfig(tmp_path / "kubeconfig"))
    async with Background(settings, tmp_path / "run", admission=ADMISSION_DRA) as background:
        assert background.error is None, background.error
    assert _device_classes(fake) == [device_class["metadata"]["name"]]


async def test_a_device_plugin_run_installs_no_device_class(
    fake: FakeApiServer, tmp_path: Path
) -> None:
    settings = _settings(fake.kubeconfig(tmp_path / "kubeconfig"))
    async with Background(settings, tmp_path / "run") as background:
        assert background.error is None, background.error
        during = _device_classes(fake)
    assert during == []


def _dra_settings(fake: FakeApiServer, tmp_path: Path, node_root: Path) -> Settings:
    return _settings(
        fake.kubeconfig(tmp_path / "kubeconfig"),
        dra_node="node-a",
        kubelet_dir=node_root / "kl",
        node_dir=node_root / "node",
        cdi_dir=node_root / "cdi",
    )


@pytest.mark.parametrize(
    ("missing", "variable"),
    [
        pytest.param("kl/plugins_registry", "FRACGPU_E2E_KUBELET_DIR", id="plugins-registry"),
        pytest.param("cdi", "FRACGPU_E2E_CDI_DIR", id="cdi-directory"),
    ],
)
def test_the_dra_agent_names_the_variable_for_a_directory_it_cannot_see(
    tmp_path: Path, node_root: Path, missing: str, variable: str
) -> None:
    for directory in ("kl/plugins_registry", "cdi"):
        if directory != missing:
            (node_root / directory).mkdir(parents=True)
    settings = _settings(
        tmp_path / "kubeconfig",
        dra_node="node-a",
        kubelet_dir=node_root / "kl",
        node_dir=node_root / "node",
        cdi_dir=node_root / "cdi",
    )
    agent = DraAgent(settings, "off1ne", fake_cards(), tmp_path)
    with pytest.raises(HarnessError, match=variable):
        agent.check_node()


async def test_the_dra_agent_prepares_claims_with_paths_its_runtime_can_use(
    fake: FakeApiServer, tmp_path: Path, node_root: Path
) -> None:
    """The real `fracgpu dra-plugin` as the DRA scenarios run it: registered with kubelet, its
    slice published, a claim the scheduler placed prepared into a CDI spec the runtime resolves
    to devices and mounts that exist on the node (the fake cards' devices are character
    devices), the limits file where the scenarios read it with what the claim consumed, and
    the spec gone once the claim is unprepared."""
    settings = _dra_settings(fake, tmp_path, node_root)
    (node_root / "cdi").mkdir()
    fake.put(_node("node-a", "127.0.0.1", control_plane=False))
    fake.put({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "team-a"}})
    (device_class,) = harness.device_classes()
    fake.put(device_class)
    agent = DraAgent(settings, "off1ne", fake_cards(), tmp_path)
    async with fake.api_client() as api:
        kubelet = FakeDraKubelet(node_root / "kl", "node-a", api)
        await kubelet.start()
        try:
            agent.prepare()
            limits_before = agent.written()
            agent.start()
            await asyncio.to_thread(_poll, agent.registered)
            await asyncio.to_thread(_poll, lambda: bool(fake.objects("resourceslices")))
            (published,) = fake.objects("resourceslices")
            fake.put(share_claim("c", cores=50, memory="8Gi", namespace="team-a"))
            claim = allocate_claim(fake.store, "team-a", "c")
            key = ClaimKey("team-a", "c", claim["metadata"]["uid"])
            prepared = await kubelet.prepare(published["spec"]["driver"], [key])
            ids = [i for d in prepared[key.uid] for i in d.cdi_device_ids]
            edits = cdiruntime.resolve([node_root / "cdi"], ids)
            devices = [d["hostPath"] for d in edits.device_nodes]
            mounts = [m["hostPath"] for m in edits.mounts]
            chars = await asyncio.to_thread(lambda: [_is_char_device(p) for p in devices])
            present = await asyncio.to_thread(lambda: [os.path.exists(p) for p in mounts])
            written = await asyncio.to_thread(agent.limits, limits_before)
            specs_prepared = agent.cdi_specs()
            await kubelet.unprepare(published["spec"]["driver"], [key])
            specs_after = agent.cdi_specs()
        finally:
            agent.stop()
            await kubelet.stop()
            agent.remove_files()
    assert len(published["spec"]["devices"]) == len(agent.cards)
    assert devices
    assert chars == [True] * len(devices)
    assert present == [True] * len(mounts)
    assert [(w.compute_percent, w.memory_bytes) for w in written] == [consumed(claim)]
    assert consumed(claim) == (50, 8 << 30)
    assert list(specs_prepared) == [key.uid]
    assert specs_after == {}
    assert agent.process is None
