"""The project's cluster scripts (hack/cluster): what can be checked without starting it.

The cluster itself is exercised by `make e2e` (docs/testing.md); these tests hold the pieces that
would otherwise fail only there: the pinned module graph, the scripts' syntax, and the image
archives containerd imports.
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import NamedTuple

import pytest

HACK = Path(__file__).resolve().parents[1] / "hack" / "cluster"
MODULES = HACK / "modules"
K8S_MODULES = sorted(MODULES.glob("k8s-*"))


def _required(go_mod: str, module: str) -> str:
    found = re.search(rf"^\s*(?:require\s+)?{re.escape(module)} (v\S+)", go_mod, re.MULTILINE)
    assert found, f"{module} is not required"
    return found.group(1)


def test_both_kubernetes_versions_are_pinned() -> None:
    assert [p.name for p in K8S_MODULES] == ["k8s-1.36", "k8s-1.37"]


@pytest.mark.parametrize("folder", K8S_MODULES, ids=lambda p: p.name)
def test_every_staging_module_is_pinned_at_the_matching_release(folder: Path) -> None:
    """k8s.io/kubernetes requires its staging modules at v0.0.0 and replaces them with its own
    folders, which no module that depends on it sees: each must be pinned at v0.<minor>.<patch>."""
    go_mod = (folder / "go.mod").read_text()
    kube = _required(go_mod, "k8s.io/kubernetes")
    assert kube.startswith(f"v{folder.name.removeprefix('k8s-')}.")
    staging = f"v0.{kube.removeprefix('v1.')}"
    replaced = dict(re.findall(r"^\s*(k8s\.io/\S+) => k8s\.io/\S+ (v\S+)$", go_mod, re.MULTILINE))
    assert "k8s.io/api" in replaced
    assert "k8s.io/client-go" in replaced
    assert {m: v for m, v in replaced.items() if v != staging} == {}


@pytest.mark.parametrize("folder", sorted(MODULES.iterdir()), ids=lambda p: p.name)
def test_each_module_builds_tools_from_the_proxy_with_sums(folder: Path) -> None:
    go_mod = (folder / "go.mod").read_text()
    assert re.search(r"^tool\b", go_mod, re.MULTILINE), "build.sh builds a module's tools"
    assert (folder / "go.sum").stat().st_size > 0
    assert "=> ./" not in go_mod and "=> ../" not in go_mod, "no source from outside the proxy"


@pytest.mark.parametrize("script", sorted(HACK.glob("*.sh")), ids=lambda p: p.name)
def test_scripts_parse(script: Path) -> None:
    subprocess.run(["bash", "-n", str(script)], check=True)


def _mkimage() -> ModuleType:
    spec = importlib.util.spec_from_file_location("mkimage", HACK / "images" / "mkimage.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _members(archive: bytes) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        return {
            m.name: (tar.extractfile(m) or io.BytesIO()).read()
            for m in tar.getmembers()
            if m.isfile()
        }


@pytest.fixture
def rootfs(tmp_path: Path) -> Path:
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "tool").write_bytes(b"\x7fELF")
    (tmp_path / "bin" / "tool").chmod(0o755)
    (tmp_path / "bin" / "sh").symlink_to("tool")
    return tmp_path


def test_an_image_archive_is_the_same_for_the_same_folder(rootfs: Path) -> None:
    mk = _mkimage()
    assert mk.archive(rootfs, ["localhost/x:1"], ["/bin/tool"], []) == mk.archive(
        rootfs, ["localhost/x:1"], ["/bin/tool"], []
    )


def test_an_image_archive_is_an_oci_layout_with_every_blob_by_its_digest(rootfs: Path) -> None:
    files = _members(_mkimage().archive(rootfs, ["localhost/x:1", "example.org/y:2"], [], ["sh"]))
    index = json.loads(files["index.json"])
    assert [m["annotations"]["io.containerd.image.name"] for m in index["manifests"]] == [
        "localhost/x:1",
        "example.org/y:2",
    ]
    blobs = {n.removeprefix("blobs/sha256/"): b for n, b in files.items() if n.startswith("blobs/")}
    assert {hashlib.sha256(b).hexdigest() for b in blobs.values()} == set(blobs)
    manifest = json.loads(blobs[index["manifests"][0]["digest"].removeprefix("sha256:")])
    (layer,) = manifest["layers"]
    config = json.loads(blobs[manifest["config"]["digest"].removeprefix("sha256:")])
    assert config["rootfs"]["diff_ids"] == [layer["digest"]]
    assert config["config"]["Cmd"] == ["sh"]
    with tarfile.open(fileobj=io.BytesIO(blobs[layer["digest"].removeprefix("sha256:")])) as tar:
        entries = {m.name: m for m in tar.getmembers()}
    assert entries["bin/sh"].issym()
    assert entries["bin/sh"].linkname == "tool"
    assert entries["bin/tool"].mode == 0o755
    assert {m.uid for m in entries.values()} == {0}


# --- stopping what up.sh started (common.sh: alive, stop), on real processes --------------------

LINGER_C = r"""
#include <pthread.h>
#include <unistd.h>
/* The leader thread ends at once; the process lives on in its other thread, as a daemon's does
 * while one thread finishes a slow call in the kernel after the leader has exited. */
static void *linger(void *arg) { (void)arg; sleep(60); return 0; }
int main(void) { pthread_t t; pthread_create(&t, 0, linger, 0); pthread_exit(0); }
"""


def _stat(pid: int) -> list[str]:
    """/proc/PID/stat's fields from the third (the state) on: the command name may hold spaces."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()


def _cluster_sh(state: Path, script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-c", f'source "{HACK}/common.sh"; {script}'],
        env={**os.environ, "FRACGPU_CLUSTER_STATE": str(state)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _record(state: Path, name: str, proc: subprocess.Popen[bytes], start: str = "") -> None:
    (state / "pids").mkdir(parents=True, exist_ok=True)
    start = start or _stat(proc.pid)[19]
    (state / "pids" / f"{name}.pid").write_text(f"{proc.pid} {start} {name}\n")


def _until(check: Callable[[], bool]) -> None:
    end = time.monotonic() + 10
    while not check():
        assert time.monotonic() < end, "the process never got there"
        time.sleep(0.02)


@pytest.fixture
def linger(tmp_path: Path) -> Path:
    # gcc is a requirement of the whole suite: `make test` builds the native library with it.
    (tmp_path / "linger.c").write_text(LINGER_C)
    subprocess.run(
        ["gcc", "-pthread", "-o", str(tmp_path / "linger"), str(tmp_path / "linger.c")], check=True
    )
    return tmp_path / "linger"


IGNORE_TERM = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"


class StopCase(NamedTuple):
    argv: list[str]  # "LINGER" stands for the compiled LINGER_C
    leader_ends_first: bool
    term_wait: int  # stop's seconds between SIGTERM and SIGKILL
    log: str  # what stop says


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(
            StopCase(["sleep", "60"], False, 30, ""), id="ends-on-sigterm-and-waits-for-its-reaper"
        ),
        pytest.param(
            StopCase([sys.executable, "-c", IGNORE_TERM], False, 1, "SIGKILL"), id="ignores-sigterm"
        ),
        pytest.param(
            StopCase(["LINGER"], True, 30, ""), id="leader-thread-ended-while-another-runs"
        ),
    ],
)
def test_stop_leaves_no_thread_of_the_process_running(
    tmp_path: Path, linger: Path, case: StopCase
) -> None:
    """The test is the parent and does not wait for the child, so a child that has ended stays a
    zombie, as one does under a slow PID 1: that is stopped. A leader that has ended while
    another of its threads runs reads Z too, yet the process still holds what it held: that is
    running. (CI's teardown once found containerd running after its stop had returned.)"""
    proc = subprocess.Popen([str(linger) if a == "LINGER" else a for a in case.argv])
    try:
        time.sleep(0.3)  # the Python child has set its handler
        if case.leader_ends_first:
            _until(lambda: _stat(proc.pid)[0] == "Z")
        _record(tmp_path, "x", proc)
        assert _cluster_sh(tmp_path, "alive x").stdout.strip() == str(proc.pid)
        stopped = _cluster_sh(tmp_path, f"stop x {case.term_wait} && ! alive x")
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        assert case.log in stopped.stdout
        assert _stat(proc.pid)[0] == "Z"
        assert len(list(Path(f"/proc/{proc.pid}/task").iterdir())) == 1
    finally:
        proc.kill()
        proc.wait()


def test_a_pid_that_another_process_reused_is_never_signalled(tmp_path: Path) -> None:
    proc = subprocess.Popen(["sleep", "60"])
    try:
        _record(tmp_path, "x", proc, start=str(int(_stat(proc.pid)[19]) - 1))
        assert _cluster_sh(tmp_path, "alive x").returncode == 1
        assert _cluster_sh(tmp_path, "stop x 1").returncode == 0
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()
