"""A node agent that stops because the release is uninstalled removes what it wrote on the node;
one that is merely restarted changes nothing (deviceplugin/shared/uninstall.py).

The shared logic is run for both agents' layouts (their own ``host_files``) against the fake API
server and a temporary node; then each daemon's stop path, end to end.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from core.informer import InformerSettings
from deviceplugin.classic.config import Config
from deviceplugin.classic.plugin import DevicePlugin
from deviceplugin.dra.config import DraConfig
from deviceplugin.dra.driver import DraDriver
from deviceplugin.shared.flags import daemonset_ref
from deviceplugin.shared.settings import DaemonSetRef
from deviceplugin.shared.uninstall import AgentFiles, UninstallWatch, clean_up, remove_host_files
from testkit.apiserver import FakeApiServer

NAMESPACE = "default"
AGENTS = {"classic": "fracgpu-device-plugin", "dra": "fracgpu-dra-plugin"}
FAST = InformerSettings(backoff_initial_s=0.02, backoff_max_s=0.05, request_timeout_s=2.0)


def daemonset(name: str, **meta: Any) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": name, "namespace": NAMESPACE, **meta},
        "spec": {"selector": {"matchLabels": {"app": name}}},
    }


def agent_files(agent: str, root: Path) -> AgentFiles:
    """The agent's own description of its host files."""
    host, cdi, kubelet = root / "host", root / "cdi", root / "kubelet"
    if agent == "classic":
        config = Config(plugin_dir=kubelet / "device-plugins", host_root=host, cdi_root=cdi)
        return DevicePlugin(config, []).host_files()

    async def no_claim(ref: Any) -> dict[str, Any]:
        raise AssertionError("no claim is read")

    dra = DraConfig(node_name="n", kubelet_root=kubelet, cdi_root=cdi, host_root=host)
    return DraDriver(dra, [], no_claim).host_files()


def lay_out(files: AgentFiles, shares: list[str]) -> None:
    """What an agent and its install-hook leave on a node serving ``shares``."""
    root = files.host_root
    (root / "lib").mkdir(parents=True)
    (root / "lib" / "libfracgpu.so").write_bytes(b"\x7fELF")
    (root / "ld.so.preload").write_text("/usr/local/fracgpu/lib/libfracgpu.so\n")
    for share in shares:
        (files.grants / share / "limits").mkdir(parents=True)
        (files.grants / share / "shared").mkdir()
        (files.grants / share / "limits" / "limits").write_text(f"limits of {share}\n")
        assert files.cdi_root is not None
        files.cdi_root.mkdir(exist_ok=True)
        (files.cdi_root / f"{files.cdi_prefix}{share}.json").write_text("{}")
    assert files.cdi_root is not None
    (files.cdi_root / "nvidia.com-gpu.json").write_text("{}")  # not fracgpu's
    assert files.checkpoint is not None
    files.checkpoint.parent.mkdir(parents=True, exist_ok=True)
    files.checkpoint.write_text("{}")
    for socket in files.sockets:
        socket.parent.mkdir(parents=True, exist_ok=True)
        socket.write_text("")


def snapshot(root: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under ``root`` with its content and modification time."""
    found: dict[str, tuple[bytes, int]] = {}
    for path in sorted(root.rglob("*")):
        stat = path.stat()
        found[str(path.relative_to(root))] = (
            path.read_bytes() if path.is_file() else b"",
            stat.st_mtime_ns,
        )
    return found


@dataclass(frozen=True)
class Case:
    own: str = "present"  # at the stop: present, gone, deleting (foreground deletion)
    other: bool = False  # the other agent's DaemonSet exists (a mode switch)
    running: tuple[str, ...] = ()  # shares that still run, of "s1", "s2"
    down: str = ""  # "": the API server answers; "before": never did; "at-stop": not any more
    seen: bool = True  # its DaemonSet existed while it ran (else: --daemonset names another)


CASES = [
    pytest.param(Case(), "nothing", id="restart-daemonset-present"),
    pytest.param(Case(own="gone"), "everything", id="uninstall-nothing-running"),
    pytest.param(Case(own="deleting"), "everything", id="uninstall-foreground-deletion"),
    pytest.param(Case(own="gone", running=("s1",)), "keep-s1", id="uninstall-s1-still-running"),
    pytest.param(Case(own="gone", other=True), "keep-hook", id="mode-switch-other-agent-exists"),
    pytest.param(Case(own="gone", down="before"), "nothing", id="api-server-never-reachable"),
    pytest.param(Case(own="present", down="at-stop"), "nothing", id="unreachable-after-restart"),
    # helm uninstall: the DaemonSet goes first, the agent's RoleBinding and ServiceAccount right
    # after; the watch saw the deletion before its token was refused
    pytest.param(Case(own="gone", down="at-stop"), "everything", id="unreachable-after-deletion"),
    pytest.param(Case(own="gone", seen=False), "nothing", id="daemonset-never-seen"),
]


async def _wait(predicate: Callable[[], bool], within_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + within_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def verdict_for(fake: FakeApiServer, case: Case, agent: str) -> Any:
    own = AGENTS[agent]
    other = next(name for name in AGENTS.values() if name != own)
    if case.seen:
        fake.put(daemonset(own))
    if case.other:
        fake.put(daemonset(other))
    if case.down == "before":
        fake.down("503")
    watch = UninstallWatch(DaemonSetRef(NAMESPACE, own), timeout_s=1.0, settings=FAST)
    async with fake.api_client() as api:
        task = asyncio.create_task(watch.run(api))
        try:
            await _wait(lambda: watch._informer is not None)
            informer = watch._informer
            assert informer is not None
            if case.down != "before":
                await _wait(lambda: informer.has_synced)
            else:
                await _wait(lambda: informer.stats.errors > 0)  # it tried
            if case.own == "gone" and case.seen:
                fake.remove("daemonsets", own, NAMESPACE)
                if case.down != "before":
                    await _wait(lambda: informer.get(own, NAMESPACE) is None)
            elif case.own == "deleting":
                fake.put(daemonset(own, deletionTimestamp="2026-01-01T00:00:00Z"))
            if case.down == "at-stop":
                fake.down("503")
            return await watch.decide()
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


@pytest.mark.parametrize("agent", ["classic", "dra"])
@pytest.mark.parametrize(("case", "expected"), CASES)
async def test_what_a_stopping_agent_leaves_on_its_node(
    fake: FakeApiServer, tmp_path: Path, agent: str, case: Case, expected: str
) -> None:
    files = agent_files(agent, tmp_path)
    lay_out(files, ["s1", "s2"])
    before = snapshot(tmp_path)
    verdict = await verdict_for(fake, case, agent)
    clean_up(verdict, files, set(case.running))
    after = snapshot(tmp_path)
    assert files.cdi_root is not None
    foreign = str((files.cdi_root / "nvidia.com-gpu.json").relative_to(tmp_path))
    assert after[foreign] == before[foreign], "another vendor's CDI spec is never touched"
    if expected == "nothing":
        assert after == before, verdict.why
        return
    assert verdict.uninstalled, verdict.why
    left = {name for name in after if name != foreign}
    # the directories kubelet and the runtime own stay; fracgpu's own leave nothing behind
    kept_dirs = {s.parent for s in files.sockets if s.parent != files.own_dir}
    if files.own_dir is not None:
        kept_dirs.add(files.own_dir.parent)
    outside = {"cdi", "kubelet"} | {str(d.relative_to(tmp_path)) for d in kept_dirs}
    hook = {"host", "host/lib", "host/lib/libfracgpu.so", "host/ld.so.preload"}
    grants = str(files.grants.relative_to(tmp_path))
    spec_s1 = str((files.cdi_root / f"{files.cdi_prefix}s1.json").relative_to(tmp_path))
    share_s1 = {n for n in before if n.startswith(f"{grants}/s1")} | {spec_s1}
    checkpoint = {str(files.checkpoint.relative_to(tmp_path))} if files.checkpoint else set()
    own_dir = {str(files.own_dir.relative_to(tmp_path))} if files.own_dir else set()
    if expected == "everything":
        assert left == outside
    elif expected == "keep-hook":
        assert left == outside | hook
    elif expected == "keep-s1":
        assert left == outside | hook | share_s1 | checkpoint | own_dir | {grants}
        for name in share_s1 | checkpoint:
            assert after[name] == before[name], f"{name} of a running share was touched"
    else:
        raise AssertionError(expected)
    assert not any(s.exists() for s in files.sockets)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param("fracgpu/fracgpu-dra-plugin", DaemonSetRef("fracgpu", "fracgpu-dra-plugin")),
        pytest.param("", None, id="none"),
    ],
)
def test_the_daemonset_flag(text: str, expected: DaemonSetRef | None) -> None:
    assert daemonset_ref(text) == expected


@pytest.mark.parametrize("text", ["fracgpu", "/x", "ns/", "a/b/c"])
def test_a_malformed_daemonset_flag_is_refused(text: str) -> None:
    import argparse

    with pytest.raises(argparse.ArgumentTypeError):
        daemonset_ref(text)


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        pytest.param({"POD_NAMESPACE": "gpu-system"}, "gpu-system/fracgpu-dra-plugin", id="env"),
        pytest.param({}, None, id="outside-a-pod"),
    ],
)
def test_the_flag_defaults_to_the_pods_namespace(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, env: dict[str, str], expected: str | None
) -> None:
    import argparse

    from deviceplugin.dra import cli
    from deviceplugin.shared import flags

    monkeypatch.delenv("POD_NAMESPACE", raising=False)
    monkeypatch.setattr(flags, "SERVICE_ACCOUNT_NAMESPACE", tmp_path / "absent")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["dra-plugin", "--node-name", "n"])
    resolved = flags.resolve_daemonset(args.daemonset, "fracgpu-dra-plugin")
    assert (str(resolved) if resolved else None) == expected


# ---- the daemons' stop paths, end to end ------------------------------------------------------


@pytest.mark.parametrize(
    ("deleted", "unprepared"),
    [
        pytest.param(False, False, id="restart"),
        pytest.param(True, False, id="uninstall-claim-running"),
        pytest.param(True, True, id="uninstall-nothing-running"),
    ],
)
async def test_the_dra_plugin_removes_its_files_only_when_uninstalled(
    deleted: bool, unprepared: bool
) -> None:
    from testkit.dranode import DRIVER, dra_node, share_claim

    async with dra_node(start=False) as node:
        node.fake.put(daemonset(AGENTS["dra"]))
        ref = DaemonSetRef(NAMESPACE, AGENTS["dra"])
        daemon = await node.start_plugin(daemonset=ref, uninstall_timeout_s=1.0)
        assert await node.wait_registered()
        await node.wait_slice()
        node.create_claim(share_claim("c1", cores=30, memory="8Gi"))
        claim = node.allocate("c1")
        assert node.kubelet is not None
        await node.kubelet.prepare(DRIVER, [node.key(claim)])
        config = node.plugin.config
        (config.host_root / "lib").mkdir(exist_ok=True)
        (config.host_root / "lib" / "libfracgpu.so").write_bytes(b"\x7fELF")  # install-hook's
        if unprepared:
            await node.kubelet.unprepare(DRIVER, [node.key(claim)])
        watch = daemon.uninstall
        assert watch is not None
        await _wait(lambda: watch.seen)
        if deleted:
            node.fake.remove("daemonsets", AGENTS["dra"], NAMESPACE)
            await _wait(lambda: watch._informer is not None and not watch._informer.objects())
        before = snapshot(node.root / "host")
        await node.stop_plugin()
        uid = claim["metadata"]["uid"]
        if not deleted:
            assert snapshot(node.root / "host") == before
            assert config.checkpoint_path.exists()
        elif unprepared:
            assert not config.host_root.exists()
            assert not config.plugin_dir.exists()
            assert not any(config.cdi_root.iterdir())
        else:
            kept = {n: v for n, v in before.items() if n.startswith(f"claims/{uid}")}
            assert kept and {n: snapshot(node.root / "host")[n] for n in kept} == kept
            assert (config.host_root / "ld.so.preload").exists()
            assert config.checkpoint_path.exists()
            assert [p.name for p in config.cdi_root.iterdir()] == [f"k8s.{DRIVER}-claim_{uid}.json"]
        assert not config.registry_socket.exists() and not config.service_socket.exists()


@pytest.mark.parametrize(
    ("deleted", "ended", "reconciled"),
    [
        pytest.param(False, False, False, id="restart"),
        pytest.param(True, False, False, id="uninstall-container-running"),
        pytest.param(True, True, True, id="uninstall-nothing-running"),
        # The pod ended just before the uninstall, before the reconciler's next pass confirmed
        # it gone: kubelet's list at the stop says it is not running (seen on a real cluster).
        pytest.param(True, True, False, id="uninstall-ended-not-yet-reconciled"),
    ],
)
async def test_the_device_plugin_removes_its_files_only_when_uninstalled(
    fake: FakeApiServer, deleted: bool, ended: bool, reconciled: bool
) -> None:
    from testkit.gpunode import cards, gpu_node
    from testkit.kubelet import Container, Pod

    fake.put(daemonset(AGENTS["classic"]))
    with gpu_node(cards(1), start=False) as node:
        config = node.config = dataclasses.replace(
            node.config,
            kubeconfig=fake.kubeconfig(node.root / "kubeconfig"),
            daemonset=DaemonSetRef(NAMESPACE, AGENTS["classic"]),
            uninstall_timeout_s=1.0,
        )
        daemon = await asyncio.to_thread(node.start_plugin)
        assert await asyncio.to_thread(node.wait_registered)
        pod = Pod(
            "default",
            "p",
            [Container("main", {config.core_resource: 30, config.memory_resource: 8})],
        )
        await asyncio.to_thread(node.kubelet.admit, pod)
        await asyncio.to_thread(node.kubelet.start_container, pod, "main")
        (running,) = os.listdir(config.containers_dir)
        spec = config.cdi_root / f"fracgpu.io-container_{running}.json" if config.cdi_root else None
        assert spec is not None and spec.exists()
        if ended:
            await asyncio.to_thread(node.kubelet.remove, pod)
        if reconciled:
            for _ in range(2):  # a second listing confirms it gone
                await asyncio.to_thread(node.plugin.reconcile_once)
            assert not node.plugin.running_dirs()
        watch = daemon.uninstall
        assert watch is not None
        await _wait(lambda: watch.seen)
        if deleted:
            fake.remove("daemonsets", AGENTS["classic"], NAMESPACE)
            await _wait(lambda: watch._informer is not None and not watch._informer.objects())
        before = snapshot(config.host_root)
        await asyncio.to_thread(node.stop_plugin)
        if ended:
            assert not config.host_root.exists()
            assert not spec.exists()
        else:  # a running container's files are not touched, nor the hook
            after = snapshot(config.host_root)
            assert {n: v for n, v in after.items() if n != "checkpoint.json"} == {
                n: v for n, v in before.items() if n != "checkpoint.json"
            }
            assert spec.exists() and config.checkpoint_path.exists()
        plugin_sockets = [p for p in config.plugin_dir.iterdir() if p.name.startswith("fracgpu-")]
        assert plugin_sockets == []


@pytest.mark.parametrize("agent", ["classic", "dra"])
@pytest.mark.parametrize(
    ("idle", "other_agent", "removed"),
    [
        pytest.param(True, False, True, id="no-share-of-either-mode-runs"),
        pytest.param(False, False, False, id="kubelet-lists-a-share"),
        pytest.param(None, False, False, id="kubelet-not-asked"),
        pytest.param(True, True, False, id="the-other-agent-is-installed"),
    ],
)
def test_the_other_modes_leftovers_go_once_no_share_runs(
    tmp_path: Path, agent: str, idle: bool | None, other_agent: bool, removed: bool
) -> None:
    """A helm upgrade that switched modes under a running share left that share's files (and
    the old agent's checkpoint); the new agent, uninstalled later, removes them with their CDI
    specs once kubelet lists no fracgpu share of either mode, and with them the hook."""
    files = agent_files(agent, tmp_path)
    other = agent_files("dra" if agent == "classic" else "classic", tmp_path)
    lay_out(other, ["old-share"])
    assert files.cdi_root is not None
    spec = files.cdi_root / f"{other.cdi_prefix}old-share.json"
    assert spec.exists()
    kept = remove_host_files(files, set(), other_agent=other_agent, node_idle=idle)
    assert kept == []
    left = {str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")}
    assert (other.grants.exists(), spec.exists()) == (not removed, not removed), left
    assert (files.cdi_root / "nvidia.com-gpu.json").exists()  # never fracgpu's to remove
    assert (files.host_root / "lib" / "libfracgpu.so").exists() == (not removed)
    if agent == "dra":  # the device plugin's checkpoint lies under the host root
        assert (files.host_root / "checkpoint.json").exists() == (not removed)
