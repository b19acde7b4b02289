"""The node-side contract between the device plugin and the native hook: one definition.

The device plugin writes a *limits file* (as root, into a directory it mounts read-only into the
container) and mounts the hook with ``/etc/ld.so.preload``; ``native/libfracgpu.so`` reads the
file and keeps its shared accounting region in a second, writable directory. The C side never
spells a path, key or version itself: ``native/`` generates ``fracgpu_contract.h`` from this
module at build time (``python -m core.contract c-header``), and a test proves the
Python writer and the C reader agree.

File format (version 1), ASCII, one ``key=value`` per line, ``#`` comments, order free::

    version=1
    devices=GPU-8f1c…[,GPU-…]     card UUIDs, as NVML reports them
    memory_bytes=8589934592       per card
    compute_percent=30            1–100; 100 means unthrottled

Beside it the node agent may keep a second file, ``usage`` (its own format version 1), which it
rewrites every period while the share runs: what the node measured of the share's *own* compute
use and how much the share may use now. A container cannot measure its own use (NVML's
per-process samples are keyed by host PIDs, which a container does not know) and the card-wide
utilisation counts every share on the card, so without this file a share next to a busy one is
held far below its guarantee. The limits file is unchanged by it: a hook that reads only
``limits`` keeps its behaviour, and a hook on a node that writes no ``usage`` file keeps the
card-wide controller::

    version=1
    stamp_us=1764230400000000     CLOCK_REALTIME µs at which the measured window closed
    window_us=100000              the window's length, 1 µs to 10 s
    used_percent=27               0–100: the share's own SM use over the window, summed
    ceiling_percent=30            1–100: what the share may use now (its guarantee, or more
                                  while the node lends it idle compute)

The hook trusts a ``usage`` file only while it is fresh: its stamp not older than
USAGE_MAX_AGE_US and not more than USAGE_MAX_AHEAD_US in the future. A stale, missing or
malformed file means the card-wide controller and ``compute_percent``, as without the file.
"""

from __future__ import annotations

import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

FORMAT_VERSION = 1
# Paths inside the container. The webhook denies user volumes mounted at or under these.
CONTAINER_ROOT = "/run/fracgpu"
CONTAINER_LIMITS_DIR = f"{CONTAINER_ROOT}/limits"
CONTAINER_SHARED_DIR = f"{CONTAINER_ROOT}/shared"
CONTAINER_HOOK_DIR = "/usr/local/fracgpu"
CONTAINER_HOOK_LIBRARY = f"{CONTAINER_HOOK_DIR}/lib/libfracgpu.so"
LD_SO_PRELOAD = "/etc/ld.so.preload"
LIMITS_FILE = "limits"
USAGE_FILE = "usage"
SHARED_REGION_FILE = "accounting"
# Paths on the node, under one root the webhook forbids as a hostPath in GPU pods.
HOST_ROOT = "/var/lib/fracgpu"
# Keys of the limits file.
KEY_VERSION = "version"
KEY_DEVICES = "devices"
KEY_MEMORY_BYTES = "memory_bytes"
KEY_COMPUTE_PERCENT = "compute_percent"
MAX_FILE_BYTES = 4096
MAX_DEVICES = 16
MAX_MEMORY_BYTES = 2**63 - 1  # what native/'s reader holds (int64)
# Keys and bounds of the usage file.
USAGE_FORMAT_VERSION = 1
KEY_STAMP_US = "stamp_us"
KEY_WINDOW_US = "window_us"
KEY_USED_PERCENT = "used_percent"
KEY_CEILING_PERCENT = "ceiling_percent"
USAGE_MAX_FILE_BYTES = 512  # the hook reads it every 50 ms: a few hundred bytes at most
USAGE_MAX_WINDOW_US = 10_000_000
# Older than this, the node agent is presumed gone: the hook falls back to the card's samples.
USAGE_MAX_AGE_US = 2_000_000
# Clocks of the node and the container are the same kernel's; allow for the write's own delay.
USAGE_MAX_AHEAD_US = 100_000

RESERVED_CONTAINER_PATHS = (CONTAINER_ROOT, CONTAINER_HOOK_DIR, LD_SO_PRELOAD)
# The variable through which the NVIDIA container runtime is told which cards a container sees.
# The node agent sets it; a pod that sets it itself is denied (it would pick its own cards).
VISIBLE_DEVICES_ENV = "NVIDIA_VISIBLE_DEVICES"
# Where the node agent names a container's cards to the NVIDIA container toolkit when the node
# runs it with accept-nvidia-visible-devices-as-volume-mounts = true and
# accept-nvidia-visible-devices-envvar-when-unprivileged = false (docs/install.md): one mount
# of DEVICE_LIST_HOST_PATH at DEVICE_LIST_MOUNT_ROOT/<card UUID> per card, and
# VISIBLE_DEVICES_ENV set to DEVICE_LIST_MOUNT_ROOT. The variable alone then selects nothing,
# so one a user sets (through envFrom, where admission cannot see it) hands out no card; the
# webhook denies user mounts under this directory.
DEVICE_LIST_MOUNT_ROOT = "/var/run/nvidia-container-devices"
DEVICE_LIST_HOST_PATH = "/dev/null"


class LimitsError(ValueError):
    """A limits file that does not follow the contract."""


@dataclass(frozen=True, slots=True)
class Limits:
    devices: tuple[str, ...]
    memory_bytes: int
    compute_percent: int

    def __post_init__(self) -> None:
        if not 1 <= len(self.devices) <= MAX_DEVICES:
            raise LimitsError(f"devices: 1 to {MAX_DEVICES} card UUIDs, got {len(self.devices)}")
        for uuid in self.devices:
            if not uuid or not uuid.isascii() or any(c in uuid for c in ",= \t\r\n#"):
                raise LimitsError(f"devices: {uuid!r} is not a card UUID")
        if not 0 < self.memory_bytes <= MAX_MEMORY_BYTES:
            raise LimitsError(
                f"memory_bytes must be 1 to {MAX_MEMORY_BYTES} (the C reader's range), "
                f"got {self.memory_bytes}"
            )
        if not 1 <= self.compute_percent <= 100:
            raise LimitsError(f"compute_percent must be 1–100, got {self.compute_percent}")

    def render(self) -> str:
        return (
            f"# written by the fracgpu device plugin; read by libfracgpu.so\n"
            f"{KEY_VERSION}={FORMAT_VERSION}\n"
            f"{KEY_DEVICES}={','.join(self.devices)}\n"
            f"{KEY_MEMORY_BYTES}={self.memory_bytes}\n"
            f"{KEY_COMPUTE_PERCENT}={self.compute_percent}\n"
        )

    @classmethod
    def parse(cls, text: str) -> Limits:
        """Parse with the same strictness as the C reader: unknown keys and duplicates fail."""
        values = _key_values(text, _KEYS, MAX_FILE_BYTES, "limits")
        if values[KEY_VERSION] != str(FORMAT_VERSION):
            raise LimitsError(f"unsupported version {values[KEY_VERSION]!r}")
        try:
            memory = int(values[KEY_MEMORY_BYTES])
            compute = int(values[KEY_COMPUTE_PERCENT])
        except ValueError as exc:
            raise LimitsError(str(exc)) from None
        return cls(tuple(values[KEY_DEVICES].split(",")), memory, compute)

    def write_atomic(self, directory: Path, *, durable: bool = False) -> Path:
        """Write ``directory/limits`` so that a reader sees the old file or the new, never half.

        Temp file in the same directory, rename over the target; mode 0644 so the container's
        (non-root) processes can read what they cannot change. No fsync by default: the file
        need not survive a node crash, because every container restarts after one and kubelet
        calls PreStartContainer, which rewrites it, before any of them runs; a file torn by
        the crash itself reads as malformed, which the hook treats safely (no device memory).
        Two fsyncs cost more than the rest of PreStartContainer on slow disks.
        """
        return _write_atomic(directory, LIMITS_FILE, self.render(), durable)


_KEYS = (KEY_VERSION, KEY_DEVICES, KEY_MEMORY_BYTES, KEY_COMPUTE_PERCENT)


@dataclass(frozen=True, slots=True)
class ShareUsage:
    """One period's ``usage`` file: the share's own measured use and its current ceiling."""

    stamp_us: int
    window_us: int
    used_percent: int
    ceiling_percent: int

    def __post_init__(self) -> None:
        if not 0 < self.stamp_us < 2**63:
            raise LimitsError(f"stamp_us must be a positive time in µs, got {self.stamp_us}")
        if not 0 < self.window_us <= USAGE_MAX_WINDOW_US:
            raise LimitsError(f"window_us must be 1 to {USAGE_MAX_WINDOW_US}, got {self.window_us}")
        if self.window_us > self.stamp_us:
            raise LimitsError("window_us reaches before the epoch")
        if not 0 <= self.used_percent <= 100:
            raise LimitsError(f"used_percent must be 0–100, got {self.used_percent}")
        if not 1 <= self.ceiling_percent <= 100:
            raise LimitsError(f"ceiling_percent must be 1–100, got {self.ceiling_percent}")

    def render(self) -> str:
        return (
            f"{KEY_VERSION}={USAGE_FORMAT_VERSION}\n"
            f"{KEY_STAMP_US}={self.stamp_us}\n"
            f"{KEY_WINDOW_US}={self.window_us}\n"
            f"{KEY_USED_PERCENT}={self.used_percent}\n"
            f"{KEY_CEILING_PERCENT}={self.ceiling_percent}\n"
        )

    @classmethod
    def parse(cls, text: str) -> ShareUsage:
        """Parse with the C reader's strictness (native/src/usage.c)."""
        values = _key_values(text, _USAGE_KEYS, USAGE_MAX_FILE_BYTES, "usage")
        if values[KEY_VERSION] != str(USAGE_FORMAT_VERSION):
            raise LimitsError(f"unsupported version {values[KEY_VERSION]!r}")
        numbers: dict[str, int] = {}
        for key in _USAGE_KEYS[1:]:
            if not values[key].isascii() or not values[key].isdigit() or len(values[key]) > 20:
                raise LimitsError(f"{key} must be an unsigned integer, got {values[key]!r}")
            numbers[key] = int(values[key])
        return cls(
            numbers[KEY_STAMP_US],
            numbers[KEY_WINDOW_US],
            numbers[KEY_USED_PERCENT],
            numbers[KEY_CEILING_PERCENT],
        )

    def write_atomic(self, directory: Path) -> Path:
        """Write ``directory/usage`` by rename, so the hook reads the old file or the new.

        Never fsynced: the file is rewritten every period and one lost to a crash only means
        the hook falls back to the card's samples until the agent writes the next.
        """
        return _write_atomic(directory, USAGE_FILE, self.render(), durable=False)


_USAGE_KEYS = (KEY_VERSION, KEY_STAMP_US, KEY_WINDOW_US, KEY_USED_PERCENT, KEY_CEILING_PERCENT)


def _key_values(text: str, keys: tuple[str, ...], max_bytes: int, what: str) -> dict[str, str]:
    """The ``key=value`` lines of a node-written file: every key once, no other."""
    if len(text.encode()) > max_bytes:
        raise LimitsError(f"{what} file is too large")
    values: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or key not in keys or key in values:
            raise LimitsError(f"line {number}: unexpected {line[:40]!r}")
        values[key] = value
    if set(values) != set(keys):
        raise LimitsError(f"missing keys: {sorted(set(keys) - set(values))}")
    return values


def _write_atomic(directory: Path, name: str, text: str, durable: bool) -> Path:
    """Temp file in the same directory, mode 0644, renamed over ``directory/name``."""
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / name
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="ascii") as fh:
            fh.write(text)
            if durable:
                fh.flush()
                os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if durable:
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    return target


def c_header() -> str:
    """The contract as C preprocessor definitions, for native/'s build."""
    defs = {
        "FRACGPU_FORMAT_VERSION": FORMAT_VERSION,
        "FRACGPU_LIMITS_DIR": CONTAINER_LIMITS_DIR,
        "FRACGPU_SHARED_DIR": CONTAINER_SHARED_DIR,
        "FRACGPU_LIMITS_FILE": LIMITS_FILE,
        "FRACGPU_SHARED_REGION_FILE": SHARED_REGION_FILE,
        "FRACGPU_HOOK_LIBRARY": CONTAINER_HOOK_LIBRARY,
        "FRACGPU_KEY_VERSION": KEY_VERSION,
        "FRACGPU_KEY_DEVICES": KEY_DEVICES,
        "FRACGPU_KEY_MEMORY_BYTES": KEY_MEMORY_BYTES,
        "FRACGPU_KEY_COMPUTE_PERCENT": KEY_COMPUTE_PERCENT,
        "FRACGPU_MAX_FILE_BYTES": MAX_FILE_BYTES,
        "FRACGPU_MAX_DEVICES": MAX_DEVICES,
        "FRACGPU_MAX_MEMORY_BYTES": MAX_MEMORY_BYTES,
        "FRACGPU_USAGE_FILE": USAGE_FILE,
        "FRACGPU_USAGE_FORMAT_VERSION": USAGE_FORMAT_VERSION,
        "FRACGPU_KEY_STAMP_US": KEY_STAMP_US,
        "FRACGPU_KEY_WINDOW_US": KEY_WINDOW_US,
        "FRACGPU_KEY_USED_PERCENT": KEY_USED_PERCENT,
        "FRACGPU_KEY_CEILING_PERCENT": KEY_CEILING_PERCENT,
        "FRACGPU_USAGE_MAX_FILE_BYTES": USAGE_MAX_FILE_BYTES,
        "FRACGPU_USAGE_MAX_WINDOW_US": USAGE_MAX_WINDOW_US,
        "FRACGPU_USAGE_MAX_AGE_US": USAGE_MAX_AGE_US,
        "FRACGPU_USAGE_MAX_AHEAD_US": USAGE_MAX_AHEAD_US,
    }
    lines = [
        "/* Generated from core/contract.py by `python -m core.contract c-header`.",
        " * Do not edit: change the Python module, which is the one definition. */",
        "#ifndef FRACGPU_CONTRACT_H",
        "#define FRACGPU_CONTRACT_H",
    ]
    for name, value in defs.items():
        rendered = str(value) if isinstance(value, int) else f'"{value}"'
        # Tests build the hook against a temporary directory; the production build never does.
        guard = isinstance(value, str) and name.endswith("_DIR")
        if guard:
            lines.append(f"#ifndef {name}")
        lines.append(f"#define {name} {rendered}")
        if guard:
            lines.append("#endif")
    lines.append("#endif")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # pragma: no cover - exercised by native/'s build
    if sys.argv[1:] != ["c-header"]:
        sys.exit("usage: python -m core.contract c-header")
    sys.stdout.write(c_header())
