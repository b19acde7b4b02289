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
import re
import subprocess
import tarfile
from pathlib import Path
from types import ModuleType

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
