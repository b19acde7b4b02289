"""What a CDI-enabled container runtime (containerd >= 1.7, CRI-O) does with kubelet's CDI IDs.

Loads every spec in the CDI directories as the CDI library does, strictly: unknown fields are
errors, the ``cdiVersion`` must be one the library knows and at least the version that introduced
each feature used (``deviceNodes[].hostPath`` needs 0.5.0), ``kind`` is ``vendor/class``, device
names are unique per kind (a duplicate in the same directory is a conflict), and a later
directory wins over an earlier one. ``resolve(ids)`` returns the edits a container gets: each
named device's edits plus the edits of the spec it comes from (once per spec).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

VERSIONS = ("0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0", "1.1.0")
_KIND = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9][-A-Za-z0-9_.]{0,62}$")
_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.:]*[A-Za-z0-9])?$")
TOP = {"cdiVersion", "kind", "annotations", "devices", "containerEdits"}
DEVICE = {"name", "annotations", "containerEdits"}
EDITS = {"env", "deviceNodes", "mounts", "hooks", "additionalGids", "intelRdt", "netDevices"}
DEVICE_NODE = {
    "path",
    "hostPath",
    "type",
    "major",
    "minor",
    "fileMode",
    "permissions",
    "uid",
    "gid",
}
MOUNT = {"hostPath", "containerPath", "type", "options"}


class CdiError(ValueError):
    """A spec the runtime refuses, or an ID it cannot resolve (the container fails to start)."""


@dataclass
class Edits:
    env: list[str] = field(default_factory=list)
    device_nodes: list[dict[str, Any]] = field(default_factory=list)
    mounts: list[dict[str, Any]] = field(default_factory=list)

    def add(self, edits: dict[str, Any]) -> None:
        self.env += edits.get("env") or []
        self.device_nodes += edits.get("deviceNodes") or []
        self.mounts += edits.get("mounts") or []

    def env_map(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for item in self.env:
            key, _, value = item.partition("=")
            if key in out:
                raise CdiError(f"variable {key} is set twice by the CDI edits")
            out[key] = value
        return out

    def mount(self, container_path: str) -> dict[str, Any]:
        found = [m for m in self.mounts if m["containerPath"] == container_path]
        if len(found) != 1:
            raise CdiError(f"{len(found)} mounts at {container_path}")
        return found[0]


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split("."))


def _check_edits(edits: Any, where: str, version: str) -> None:
    if not isinstance(edits, dict):
        raise CdiError(f"{where}: containerEdits must be an object")
    unknown = set(edits) - EDITS
    if unknown:
        raise CdiError(f"{where}: unknown field(s) {sorted(unknown)}")
    for node in edits.get("deviceNodes") or []:
        if set(node) - DEVICE_NODE:
            raise CdiError(
                f"{where}: unknown device node field(s) {sorted(set(node) - DEVICE_NODE)}"
            )
        if not str(node.get("path", "")).startswith("/"):
            raise CdiError(f"{where}: device node path must be absolute")
        if "hostPath" in node and _version(version) < (0, 5, 0):
            raise CdiError(
                f"{where}: deviceNodes.hostPath needs cdiVersion 0.5.0, spec says {version}"
            )
    for mount in edits.get("mounts") or []:
        if set(mount) - MOUNT:
            raise CdiError(f"{where}: unknown mount field(s) {sorted(set(mount) - MOUNT)}")
        if not mount.get("hostPath") or not mount.get("containerPath"):
            raise CdiError(f"{where}: a mount needs hostPath and containerPath")
    for item in edits.get("env") or []:
        if not isinstance(item, str) or "=" not in item:
            raise CdiError(f"{where}: env entries are KEY=VALUE strings, got {item!r}")


def load(directories: Iterable[Path]) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """Fully qualified device name -> (spec, device), later directories winning."""
    registry: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {}
    for directory in directories:
        here: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {}
        if not directory.is_dir():
            continue
        for path in sorted(directory.iterdir()):
            if path.suffix not in (".json", ".yaml") or path.name.startswith("."):
                continue
            text = path.read_text()
            spec = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
            where = str(path)
            if not isinstance(spec, dict) or set(spec) - TOP:
                raise CdiError(f"{where}: unknown top-level field(s)")
            version = spec.get("cdiVersion")
            if version not in VERSIONS:
                raise CdiError(f"{where}: unsupported cdiVersion {version!r}")
            kind = spec.get("kind")
            if not isinstance(kind, str) or not _KIND.match(kind):
                raise CdiError(f"{where}: kind {kind!r} is not vendor/class")
            devices = spec.get("devices")
            if not isinstance(devices, list) or not devices:
                raise CdiError(f"{where}: a spec needs at least one device")
            if "containerEdits" in spec:
                _check_edits(spec["containerEdits"], where, version)
            for device in devices:
                if set(device) - DEVICE:
                    raise CdiError(
                        f"{where}: unknown device field(s) {sorted(set(device) - DEVICE)}"
                    )
                name = device.get("name")
                if not isinstance(name, str) or not _NAME.match(name):
                    raise CdiError(f"{where}: invalid device name {name!r}")
                _check_edits(device.get("containerEdits") or {}, f"{where}: {name}", version)
                qualified = f"{kind}={name}"
                if qualified in here:
                    raise CdiError(f"{where}: conflicting device {qualified}")
                here[qualified] = (spec, device)
        registry.update(here)
    return registry


def resolve(directories: Iterable[Path], ids: Iterable[str]) -> Edits:
    registry = load(directories)
    edits = Edits()
    applied: list[int] = []
    for cdi_id in ids:
        if cdi_id not in registry:
            raise CdiError(f"unresolvable CDI devices {cdi_id}")
        spec, device = registry[cdi_id]
        if id(spec) not in applied:
            applied.append(id(spec))
            edits.add(spec.get("containerEdits") or {})
        edits.add(device.get("containerEdits") or {})
    return edits
