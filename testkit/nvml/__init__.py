"""Build and drive the fake NVML library (fake_nvml.c) from tests."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

SOURCE = Path(__file__).with_name("fake_nvml.c")


@dataclass(frozen=True)
class FakeCard:
    uuid: str
    memory_mib: int
    minor: int
    numa: int = -1
    name: str = "NVIDIA Fake GPU 24GB"


def build(out_dir: Path) -> Path:
    """Compile the fake into ``out_dir/libnvidia-ml.so.1`` (soname included) and return it."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("the fake NVML needs a C compiler (cc)")
    out = out_dir / "libnvidia-ml.so.1"
    subprocess.run(
        [compiler, "-shared", "-fPIC", "-O1", "-Wall", "-Wextra", "-Werror",
         "-Wl,-soname,libnvidia-ml.so.1", "-o", str(out), str(SOURCE), "-lpthread"],
        check=True,
    )  # fmt: skip
    return out


def build_cached() -> Path:
    """Build once per source version into the temp directory (tests in one run share it)."""
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    directory = Path(tempfile.gettempdir()) / f"fracgpu-fake-nvml-{digest}"
    library = directory / "libnvidia-ml.so.1"
    if not library.exists():
        directory.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=directory))
        built = build(staging)
        built.replace(library)  # atomic: parallel test runs never load a half-written file
        staging.rmdir()
    return library


class FakeNvml:
    """The test's handle on the fake: writes its card config and appends injected events."""

    def __init__(self, directory: Path, cards: list[FakeCard]) -> None:
        self.config = directory / "nvml.conf"
        self.events = directory / "nvml.events"
        self.config.write_text(
            "".join(f"card {c.uuid} {c.memory_mib} {c.minor} {c.numa} {c.name}\n" for c in cards)
        )
        self.events.write_text("")

    def env(self) -> dict[str, str]:
        return {"FAKE_NVML_CONFIG": str(self.config), "FAKE_NVML_EVENTS": str(self.events)}

    def _append(self, line: str) -> None:
        with self.events.open("a") as fh:
            fh.write(line + "\n")

    def xid(self, card: int, code: int) -> None:
        self._append(f"xid {card} {code}")

    def double_bit_ecc(self, card: int) -> None:
        self._append(f"dbe {card}")

    def lose(self, card: int) -> None:
        self._append(f"lost {card}")

    def restore(self, card: int) -> None:
        self._append(f"back {card}")

    def fail_waits(self, count: int) -> None:
        self._append(f"fail_wait {count}")

    def process(self, card: int, pid: int, used_mib: int, *, graphics: bool = False) -> None:
        """``pid`` holds ``used_mib`` MiB on ``card`` (-1: NVML cannot tell)."""
        self._append(f"{'graphics' if graphics else 'proc'} {card} {pid} {used_mib}")

    def exit(self, card: int, pid: int) -> None:
        self._append(f"exit {card} {pid}")

    def fail_processes(self, count: int) -> None:
        self._append(f"fail_procs {count}")

    def busy(self, card: int, pid: int, percent: int) -> None:
        """``pid`` keeps ``percent`` % of ``card``'s SMs busy (-1: no samples, idle)."""
        self._append(f"sm {card} {pid} {percent}")

    def unsampled(self, card: int) -> None:
        """``card`` does not sample per-process utilisation (NVML: NOT_SUPPORTED)."""
        self._append(f"unsampled {card}")
