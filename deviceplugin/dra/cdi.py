"""CDI specs: how a prepared claim reaches the container through the runtime (containerd, CRI-O).

One spec file per claim in the CDI directory, named after the claim UID. kubelet hands the
runtime the IDs returned by NodePrepareResources; the runtime looks them up here and applies
their edits to the container: the hook library and ``/etc/ld.so.preload`` (read-only), the
claim's limits directory (read-only) and accounting directory (read-write), the card device
nodes, and the environment (which cards, and the grant in the user's units).

Every device of a claim gets its own CDI name (``<claim uid>-<device>[-<share id>]``): two
devices under one name collapse into one entry in kubelet's PodResources and health reports.
The mounts and variables are the spec's common edits, applied once however many of its
devices a container gets. The spec version is the oldest that has what the spec uses (0.5.0
for ``hostPath`` on device nodes): runtimes refuse specs newer than they know.

Files are written atomically (temp file, rename) so a runtime never reads half a spec.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from core import contract
from core.units import CORE_PER_CARD, ENV_GPU, ENV_GPU_COUNT, ENV_MEMORY_MIB, MIB, format_cards
from deviceplugin.dra.claims import Result
from deviceplugin.shared.cdispec import CDI_VERSION, CONTROL_DEVICES

CLASS = "claim"


def kind(driver: str) -> str:
    """``k8s.gpu.fracgpu.io/claim``: the vendor part is the driver's name, as DRA drivers do."""
    return f"k8s.{driver}/{CLASS}"


def device_name(claim_uid: str, result: Result) -> str:
    suffix = f"-{result.share_id}" if result.share_id else ""
    return f"{claim_uid}-{result.device}{suffix}"


def qualified(driver: str, claim_uid: str, result: Result) -> str:
    return f"{kind(driver)}={device_name(claim_uid, result)}"


def spec_path(cdi_root: Path, driver: str, claim_uid: str) -> Path:
    vendor, cls = kind(driver).split("/")
    return cdi_root / f"{vendor}-{cls}_{claim_uid}.json"


def claim_uid_of(path: Path, driver: str) -> str | None:
    """The claim UID a spec file of this driver was written for (None: not one of ours)."""
    vendor, cls = kind(driver).split("/")
    prefix = f"{vendor}-{cls}_"
    if not path.name.startswith(prefix) or path.suffix != ".json":
        return None
    return path.name[len(prefix) : -len(".json")] or None


def spec(
    *,
    driver: str,
    claim_uid: str,
    granted: list[Result],
    limits_dir: Path,
    shared_dir: Path,
    hook_library: Path,
    ld_so_preload: Path,
    dev_root: Path,
) -> dict[str, Any]:
    cards = list({r.card.uuid: r.card for r in granted}.values())
    devices = []
    for result in granted:
        node = f"/dev/nvidia{result.card.minor}"
        devices.append(
            {
                "name": device_name(claim_uid, result),
                "containerEdits": {
                    "deviceNodes": [
                        {"path": node, "hostPath": str(dev_root / f"nvidia{result.card.minor}")}
                    ]
                },
            }
        )
    # Whole cards say how many (FRACGPU_GPU=2, as in device-plugin mode); a share says the share
    # of each card, and FRACGPU_GPU_COUNT on how many cards it holds it.
    cores = granted[0].cores
    shown = sum(r.cores for r in granted) if cores >= CORE_PER_CARD else cores
    memory_mib = granted[0].memory_bytes // MIB
    # As in device-plugin mode, the NVIDIA toolkit is told the cards by device-list mounts only
    # the node agent makes; the variable names their directory and selects nothing by itself.
    env = [
        f"{contract.VISIBLE_DEVICES_ENV}={contract.DEVICE_LIST_MOUNT_ROOT}",
        f"{ENV_GPU}={format_cards(shown)}",
        f"{ENV_GPU_COUNT}={len(cards)}",
        f"{ENV_MEMORY_MIB}={memory_mib}",
    ]
    mounts = [
        (hook_library, contract.CONTAINER_HOOK_LIBRARY, "ro"),
        (ld_so_preload, contract.LD_SO_PRELOAD, "ro"),
        (limits_dir, contract.CONTAINER_LIMITS_DIR, "ro"),
        (shared_dir, contract.CONTAINER_SHARED_DIR, "rw"),
        *(
            (
                Path(contract.DEVICE_LIST_HOST_PATH),
                f"{contract.DEVICE_LIST_MOUNT_ROOT}/{card.uuid}",
                "ro",
            )
            for card in cards
        ),
    ]
    return {
        "cdiVersion": CDI_VERSION,
        "kind": kind(driver),
        "devices": devices,
        "containerEdits": {
            "env": env,
            "deviceNodes": [
                {"path": f"/dev/{name}", "hostPath": str(dev_root / name)}
                for name in CONTROL_DEVICES
            ],
            "mounts": [
                {
                    "hostPath": str(host),
                    "containerPath": path,
                    "type": "bind",
                    "options": [mode, "nosuid", "nodev", "bind"],
                }
                for host, path, mode in mounts
            ],
        },
    }


def specs(cdi_root: Path, driver: str) -> Iterable[tuple[str, Path]]:
    """(claim UID, path) of every spec this driver wrote."""
    if not cdi_root.is_dir():
        return []
    found = []
    for path in cdi_root.iterdir():
        uid = claim_uid_of(path, driver)
        if uid is not None:
            found.append((uid, path))
    return found
