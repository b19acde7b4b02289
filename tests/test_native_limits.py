"""The limits file between the device plugin (Python writer) and the hook (C reader): both read
the same thing, hostile files never crash the hook, and no file means a pure pass-through."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core.contract import LIMITS_FILE, MAX_DEVICES, MAX_FILE_BYTES, Limits, LimitsError
from testkit.native_kit import (
    CUDA_ERROR_OUT_OF_MEMORY,
    CUDA_SUCCESS,
    FAKE_UUID,
    MIB,
    NATIVE,
    Kit,
    sanitized_kit,
)

CARD = 16384 * MIB  # the fake card's size


def c_reads(kit: Kit, path: Path) -> tuple[int, str]:
    proc = subprocess.run(
        [str(kit.build / "limits_dump"), str(path)],
        env=kit.env(hooked=False),
        capture_output=True,
        text=True,
        check=False,
    )
    return proc.returncode, proc.stdout


uuids = st.text(
    alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E, exclude_characters=",=#"),
    min_size=1,
    max_size=60,
)


# Each example runs a C program: slow by hypothesis's standards, and slower on a loaded machine.
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    devices=st.lists(uuids, min_size=1, max_size=MAX_DEVICES),
    memory=st.integers(min_value=1, max_value=2**63 - 1),
    compute=st.integers(min_value=1, max_value=100),
)
def test_the_python_writer_and_the_c_reader_agree(
    devices: list[str], memory: int, compute: int
) -> None:
    kit = sanitized_kit()
    written = Limits(tuple(devices), memory, compute)
    path = written.write_atomic(kit.root / "agree")
    rc, out = c_reads(kit, path)
    assert rc == 0, out
    assert Limits.parse(out.replace("devices=", "version=1\ndevices=", 1)) == written


def doc(**fields: str) -> bytes:
    """A limits file with valid values except those given (None drops the key)."""
    values = {"version": "1", "devices": "GPU-a", "memory_bytes": "1", "compute_percent": "5"}
    values.update(fields)
    return "".join(f"{k}={v}\n" for k, v in values.items() if v != "<drop>").encode()


HOSTILE: list[tuple[str, bytes]] = [
    ("empty", b""),
    ("garbage", bytes(range(256))),
    ("too large", b"# " + b"x" * MAX_FILE_BYTES + b"\n"),
    ("unknown key", doc(shell="1")),
    ("repeated key", doc() + b"memory_bytes=9\n"),
    ("missing key", doc(memory_bytes="<drop>")),
    ("version 2", doc(version="2")),
    ("negative", doc(memory_bytes="-1")),
    ("zero", doc(memory_bytes="0")),
    ("overflow", doc(memory_bytes="99999999999999999999999")),
    ("beyond int64", doc(memory_bytes=str(2**63))),
    ("percent 0", doc(compute_percent="0")),
    ("percent 101", doc(compute_percent="101")),
    ("no devices", doc(devices="")),
    ("empty device", doc(devices="GPU-a,,GPU-b")),
    ("17 devices", doc(devices=",".join(["G"] * 17))),
    ("NUL", doc(memory_bytes="1\x00")),
    ("no equals", doc(memory_bytes="<drop>") + b"memory_bytes 1\n"),
]


@pytest.mark.parametrize(("name", "content"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_files_are_refused_by_both_readers(kit: Kit, name: str, content: bytes) -> None:
    path = kit.write_raw_limits(content)
    rc, out = c_reads(kit, path)
    assert rc == 2, out
    assert out.startswith("invalid "), out
    with pytest.raises((LimitsError, UnicodeDecodeError)):
        Limits.parse(content.decode("ascii"))


@pytest.mark.parametrize(("name", "content"), HOSTILE[:6], ids=[h[0] for h in HOSTILE[:6]])
def test_a_malformed_file_refuses_memory_and_leaves_compute_alone(
    kit: Kit, name: str, content: bytes
) -> None:
    kit.write_raw_limits(content)
    out = kit.probe(
        "init", "alloc:1", "async:1", "vmm:2097152", "info", "nvml", "launch:50", "util"
    )
    assert out.rcs("alloc") == out.rcs("async") == out.rcs("vmm") == [CUDA_ERROR_OUT_OF_MEMORY]
    assert out.one("info") == [0, 0, 0]
    assert out.one("nvml")[0] == 0
    assert out.one("launch")[0] == CUDA_SUCCESS
    (message,) = out.hook_messages  # one clear line, whatever was asked
    assert str(kit.limits_dir / LIMITS_FILE) in message
    assert "refused" in message


def test_a_directory_fifo_or_device_in_place_of_the_file_is_refused(kit: Kit) -> None:
    target = kit.limits_dir / LIMITS_FILE
    target.mkdir()
    assert kit.probe("init", "alloc:1").rcs("alloc") == [CUDA_ERROR_OUT_OF_MEMORY]
    target.rmdir()
    os.mkfifo(target)  # opening must not block
    assert kit.probe("init", "alloc:1", timeout=20).rcs("alloc") == [CUDA_ERROR_OUT_OF_MEMORY]
    target.unlink()
    target.symlink_to("/dev/zero")
    assert kit.probe("init", "alloc:1").rcs("alloc") == [CUDA_ERROR_OUT_OF_MEMORY]


def test_an_unusable_accounting_directory_refuses_memory(kit: Kit) -> None:
    kit.write_limits(100 * MIB)
    kit.shared_dir.rmdir()
    kit.shared_dir.write_text("not a directory")
    out = kit.probe("init", "alloc:1")
    assert out.rcs("alloc") == [CUDA_ERROR_OUT_OF_MEMORY]
    (message,) = out.hook_messages
    assert "accounting" in message


def test_a_foreign_accounting_region_is_not_trusted(kit: Kit) -> None:
    kit.write_limits(100 * MIB)
    kit.region.write_bytes(b"\xff" * 65536)
    out = kit.probe("init", "alloc:1")
    assert out.rcs("alloc") == [CUDA_ERROR_OUT_OF_MEMORY]
    assert "unknown layout" in out.hook_messages[0]


def leave_the_container(kit: Kit) -> None:
    """What a process outside any fracgpu container sees: neither directory the device plugin
    mounts exists (and the kit's hook is not at the installed path)."""
    shutil.rmtree(kit.limits_dir)
    shutil.rmtree(kit.shared_dir)


@pytest.mark.parametrize("mode", ["proc", "dlsym", "direct"])
def test_outside_a_fracgpu_container_the_hook_passes_everything_through(
    kit: Kit, mode: str
) -> None:
    leave_the_container(kit)
    out = kit.probe(
        "init", "info", "total", "nvml", f"alloc:{CARD - MIB}", "alloc:1", "freeall", mode=mode
    )
    assert out.one("info") == [0, CARD, CARD]
    assert out.one("total") == [0, CARD]
    assert out.one("nvml")[1] == CARD
    assert out.rcs("alloc") == [CUDA_SUCCESS, CUDA_SUCCESS]
    assert out.stderr == ""
    assert not kit.region.exists()


def test_the_limits_file_is_read_from_the_compiled_path_only(kit: Kit, tmp_path: Path) -> None:
    # Variables a user controls change nothing: the release build has no override at all, and
    # this test build only knows the directory it was compiled with.
    Limits((FAKE_UUID,), 10 * MIB, 100).write_atomic(tmp_path)
    leave_the_container(kit)
    out = kit.probe(
        "init",
        "info",
        env={"FRACGPU_LIMITS_DIR": str(tmp_path), "FRACGPU_DISABLE": "1", "HOME": str(tmp_path)},
    )
    assert out.one("info") == [0, CARD, CARD]


def test_the_release_build_reads_the_container_paths() -> None:
    # The build `make setup` makes (incremental: a no-op when it is up to date).
    subprocess.run(
        ["make", "-s", "-C", "native", f"PYTHON={sys.executable}"], check=True, capture_output=True
    )
    data = (NATIVE / "build" / "libfracgpu.so").read_bytes()
    assert b"/run/fracgpu/limits/limits" in data
    assert b"/run/fracgpu/shared/accounting" in data
    assert b"getenv" not in data
