"""What both agents keep on the node for the hook: its library, the preload file, each grant's
limits and accounting directories, and the limits file itself.

Host layout under ``host_root`` (default ``/var/lib/fracgpu``), the part both modes share::

    lib/libfracgpu.so     the hook, installed by the DaemonSet; mounted read-only
    ld.so.preload         names the hook's container path; mounted read-only
    <grant>/limits/       a grant's limits file; mounted read-only
    <grant>/shared/       the hook's accounting region of the grant; mounted read-write

A grant is a container in device-plugin mode (``containers/<dir>``) and a claim in DRA mode
(``claims/<uid>``).
"""

from __future__ import annotations

import os
from pathlib import Path

from core import contract
from core.contract import Limits

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
    "write_limits",
]
