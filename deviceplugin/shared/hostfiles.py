"""What both agents keep on the node for the hook: its library, the preload file, each grant's
limits and accounting directories, and the limits file itself.

Host layout under ``host_root`` (default ``/var/lib/fracgpu``), the part both modes share::

    lib/libfracgpu.so     the hook, installed by the DaemonSet; mounted read-only
    ld.so.preload         names the hook's container path; mounted read-only
    <grant>/limits/       a grant's limits file (and the usage file the guard keeps fresh);
                          mounted read-only
    <grant>/shared/       the hook's accounting region of the grant; mounted read-write
    <grant>/policy        the grant's compute policy (core/policy.py) when it is not a hard
                          cap: the agent's own, never mounted

A grant is a container in device-plugin mode (``containers/<dir>``) and a claim in DRA mode
(``claims/<uid>``).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path

from core import contract
from core.contract import Limits
from core.policy import HARD_CAP, PolicyError, SharePolicy

log = logging.getLogger(__name__)
POLICY_FILE = "policy"
# The device plugin's checkpoint, under the host root (the DRA plugin keeps its own in its
# kubelet plugin folder); named here because a DRA plugin removes it after a mode switch.
DEVICE_PLUGIN_CHECKPOINT = "checkpoint.json"

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def hook_library(host_root: Path) -> Path:
    """Where the node keeps the hook that containers get mounted."""
    return host_root / "lib" / "libfracgpu.so"


def ld_so_preload(host_root: Path) -> Path:
    """The preload file naming the hook's path inside containers."""
    return host_root / "ld.so.preload"


def install_preload(preload: Path) -> None:
    """Write the ``ld.so.preload`` file that containers get mounted over theirs."""
    content = f"{contract.CONTAINER_HOOK_LIBRARY}\n"
    if not preload.exists() or preload.read_text() != content:
        preload.parent.mkdir(parents=True, exist_ok=True)
        tmp = preload.with_name(f".{preload.name}.tmp")
        tmp.write_text(content)
        os.chmod(tmp, 0o644)
        os.replace(tmp, preload)


def make_grant_dirs(limits_dir: Path, shared_dir: Path) -> None:
    """Create a grant's limits and accounting directories (idempotent). The accounting one is
    world-writable because the container's user, possibly not root, keeps its region there."""
    limits_dir.mkdir(parents=True, exist_ok=True)
    try:
        shared_dir.mkdir()
    except FileExistsError:
        return  # made before, with its mode
    os.chmod(shared_dir, 0o777)  # mkdir's mode is cut by the umask


def write_limits(limits_dir: Path, limits: Limits, *, fresh: bool = False) -> bool:
    """Write the grant's limits file unless it already says exactly this; True if written.

    Both agents repeat the step (PreStartContainer per resource and per restart, a claim's
    restore), and a container may be reading the file: an unchanged one is left alone.
    ``fresh``: a grant known to have no file yet, written without reading what is there.
    """
    rendered = limits.render()
    if not fresh:
        try:
            current = (limits_dir / contract.LIMITS_FILE).read_text(encoding="ascii")
        except (OSError, UnicodeDecodeError):
            current = None
        if current == rendered:
            return False
    limits.write_atomic(limits_dir)
    return True


def read_limits(limits_dir: Path) -> Limits:
    """The grant's limits file; raises OSError, UnicodeDecodeError or LimitsError."""
    return Limits.parse((limits_dir / contract.LIMITS_FILE).read_text(encoding="ascii"))


def write_policy(grant_dir: Path, policy: SharePolicy) -> None:
    """Keep the grant's policy beside its limits directory; a hard cap is the absence of one."""
    target = grant_dir / POLICY_FILE
    if policy == HARD_CAP:
        target.unlink(missing_ok=True)
        return
    fd, tmp = tempfile.mkstemp(prefix=".policy.", dir=grant_dir)
    try:
        with os.fdopen(fd, "w", encoding="ascii") as fh:
            json.dump(policy.to_json(), fh, sort_keys=True)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_policy(grant_dir: Path) -> SharePolicy:
    """The grant's policy; a hard cap when it has none or it cannot be read (the safe side:
    a share that cannot be shown to burst is held to its guarantee)."""
    try:
        raw = (grant_dir / POLICY_FILE).read_text(encoding="ascii")
    except FileNotFoundError:
        return HARD_CAP
    except (OSError, UnicodeDecodeError) as exc:
        log.warning("policy file unreadable", extra={"grant": str(grant_dir), "error": str(exc)})
        return HARD_CAP
    try:
        return SharePolicy.from_json(json.loads(raw))
    except (ValueError, PolicyError) as exc:
        log.warning("policy file malformed", extra={"grant": str(grant_dir), "error": str(exc)})
        return HARD_CAP


def boot_id() -> str:
    """This boot of the node ("" when unknown): a checkpoint from another boot has stale CDI
    specs and device files behind it."""
    try:
        return BOOT_ID.read_text().strip()
    except OSError:
        return ""


__all__ = [
    "BOOT_ID",
    "boot_id",
    "hook_library",
    "install_preload",
    "ld_so_preload",
    "make_grant_dirs",
    "read_limits",
    "read_policy",
    "write_limits",
    "write_policy",
]
