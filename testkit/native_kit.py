"""Builds and runs the native hook against the fake CUDA driver and NVML (no GPU needed).

The hook reads its limits only from paths compiled in, so the kit builds a test variant of
``libfracgpu.so`` whose limits and shared directories point into one temporary root (the
production build has no such override). The build happens once per pytest session, with
AddressSanitizer + UndefinedBehaviorSanitizer unless ``sanitize=False`` (the benchmark's case).
"""

from __future__ import annotations

import atexit
import functools
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from core.contract import LIMITS_FILE, SHARED_REGION_FILE, Limits

REPO = Path(__file__).resolve().parents[1]
NATIVE = REPO / "native"
# What the fake driver calls its card 0 (native/tests/fake_cuda.c, cuDeviceGetUuid).
FAKE_UUID = "GPU-10111213-1415-1617-1819-1a1b1c1d1e00"
MIB = 1 << 20
CUDA_SUCCESS = 0
CUDA_ERROR_OUT_OF_MEMORY = 2


@dataclass(frozen=True)
class Kit:
    root: Path
    sanitize: bool

    @property
    def build(self) -> Path:
        return self.root / "build"

    @property
    def limits_dir(self) -> Path:
        return self.root / "limits"

    @property
    def shared_dir(self) -> Path:
        return self.root / "shared"

    @property
    def hook(self) -> Path:
        return self.build / "libfracgpu.so"

    def reset(self) -> None:
        """Start a test from a node with no limits file and an empty accounting directory."""
        for d in (self.limits_dir, self.shared_dir):
            if d.is_dir() and not d.is_symlink():
                shutil.rmtree(d)
            else:
                d.unlink(missing_ok=True)
            d.mkdir(parents=True)

    def write_limits(
        self, memory_bytes: int, compute_percent: int = 100, devices: Sequence[str] = (FAKE_UUID,)
    ) -> Path:
        return Limits(tuple(devices), memory_bytes, compute_percent).write_atomic(self.limits_dir)

    def write_raw_limits(self, content: bytes) -> Path:
        path = self.limits_dir / LIMITS_FILE
        path.write_bytes(content)
        return path

    @property
    def region(self) -> Path:
        return self.shared_dir / SHARED_REGION_FILE

    @property
    def shared_card(self) -> Path:
        """The file that puts every process naming it (FAKE_CUDA_SHARED_CARD) on one fake card."""
        return self.root / "card"

    def share_hook(self, name: str) -> Path:
        """The hook of share ``name`` ("a" or "b"): a container of its own, whose limits and
        usage file are in :meth:`share_limits_dir`. Built on first use (make share-hooks)."""
        _build_share_hooks(self)
        return self.build / f"share-{name}" / "libfracgpu.so"

    def share_limits_dir(self, name: str) -> Path:
        return self.root / f"share-{name}" / "limits"

    def reset_share(self, name: str) -> None:
        for sub in ("limits", "shared"):
            d = self.root / f"share-{name}" / sub
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir(parents=True)

    def env(
        self,
        hooked: bool = True,
        extra: Mapping[str, str] | None = None,
        hook: Path | None = None,
    ) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("FAKE_CUDA_", "LD_"))}
        env["LD_LIBRARY_PATH"] = str(self.build / "fake")
        preload = []
        if self.sanitize:
            preload.append(asan_runtime())
            env["ASAN_OPTIONS"] = "detect_leaks=1:abort_on_error=0:exitcode=86"
            env["UBSAN_OPTIONS"] = "halt_on_error=1:print_stacktrace=1:exitcode=87"
        if hooked:
            preload.append(str(hook or self.hook))
        if preload:
            env["LD_PRELOAD"] = " ".join(preload)
        env.update(extra or {})
        return env

    def command(self, ops: Sequence[str], mode: str = "proc") -> list[str]:
        if mode == "direct":
            return [str(self.build / "probe_direct"), *ops]
        return [str(self.build / "probe"), mode, *ops]

    def probe(
        self,
        *ops: str,
        mode: str = "proc",
        hooked: bool = True,
        env: Mapping[str, str] | None = None,
        timeout: float = 60,
    ) -> Probe:
        proc = subprocess.run(
            self.command(ops, mode),
            env=self.env(hooked, env),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        result = Probe(proc.returncode, proc.stdout, proc.stderr)
        result.check_clean()
        return result


@dataclass(frozen=True)
class Probe:
    returncode: int
    stdout: str
    stderr: str

    def check_clean(self) -> None:
        assert self.returncode == 0, f"probe exited {self.returncode}:\n{self.stderr}"
        for marker in ("AddressSanitizer", "runtime error:", "LeakSanitizer"):
            assert marker not in self.stderr, self.stderr

    @property
    def lines(self) -> list[list[str]]:
        return [line.split() for line in self.stdout.splitlines()]

    def values(self, op: str) -> list[list[int]]:
        """Every line of op, as integers."""
        return [[int(float(v)) for v in line[1:]] for line in self.lines if line[0] == op]

    def one(self, op: str) -> list[int]:
        found = self.values(op)
        assert len(found) == 1, f"{op}: {found}\n{self.stdout}"
        return found[0]

    def rcs(self, op: str) -> list[int]:
        return [v[0] for v in self.values(op)]

    @property
    def hook_messages(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.startswith("fracgpu: ")]


@functools.cache
def asan_runtime() -> str:
    out = subprocess.run(
        ["cc", "-print-file-name=libasan.so"], capture_output=True, text=True, check=True
    ).stdout.strip()
    return out


def build_kit(sanitize: bool) -> Kit:
    """Build the test variant of the hook, the fakes and the probes into a fresh temp root."""
    root = Path(tempfile.mkdtemp(prefix="fracgpu-native-"))
    atexit.register(shutil.rmtree, root, True)
    kit = Kit(root, sanitize)
    made = subprocess.run(
        [
            "make",
            "-s",
            "-C",
            str(NATIVE),
            "test-build",
            f"BUILD={kit.build}",
            f"TESTROOT={root}",
            f"SAN={1 if sanitize else 0}",
            f"PYTHON={sys.executable}",
        ],
        check=False,
        capture_output=True,
        text=True,
    )
    if made.returncode != 0:
        raise RuntimeError(f"building native/ failed:\n{made.stdout}\n{made.stderr}")
    kit.reset()
    return kit


@functools.cache
def _build_share_hooks(kit: Kit) -> None:
    made = subprocess.run(
        [
            "make",
            "-s",
            "-j2",
            "-C",
            str(NATIVE),
            "share-hooks",
            f"BUILD={kit.build}",
            f"TESTROOT={kit.root}",
            f"SAN={1 if kit.sanitize else 0}",
            f"PYTHON={sys.executable}",
        ],
        check=False,
        capture_output=True,
        text=True,
    )
    if made.returncode != 0:
        raise RuntimeError(f"building the share hooks failed:\n{made.stdout}\n{made.stderr}")


@functools.cache
def sanitized_kit() -> Kit:
    """The one sanitizer build of this pytest session."""
    return build_kit(sanitize=True)


@functools.cache
def torch_gpu_uuid() -> str | None:
    """Card 0's UUID where an NVIDIA GPU, its driver and torch are here (the GPU tests), else
    None."""
    if importlib.util.find_spec("torch") is None:
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
        uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(0))
    except Exception:
        return None
    return uuid.decode() if isinstance(uuid, bytes) else str(uuid)


def release_kit() -> Kit:
    """The release flags (-O2, no sanitizers), pointed at a temp root like the test build."""
    return build_kit(sanitize=False)
