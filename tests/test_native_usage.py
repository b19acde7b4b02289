"""The usage file between the node agent (Python writer, core/contract.py) and the hook (C
reader, native/src/usage.c): its C unit test case by case on the sanitizer build, the two
readers agreeing on written and hostile files, and the limits file left as it was, so an older
hook reads what the new Python writes."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core.contract import USAGE_MAX_WINDOW_US, Limits, LimitsError, ShareUsage
from testkit.native_kit import Kit, sanitized_kit

CASES = [
    "a good file",
    "hostile files refused",
    "each window taken once",
    "stale, future, garbage and absent turn it off",
    "only a regular file",
]


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> subprocess.CompletedProcess[str]:
    kit = sanitized_kit()
    return subprocess.run(
        [str(kit.build / "usage_test"), str(tmp_path_factory.mktemp("usage"))],
        env=kit.env(hooked=False),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_the_unit_test_exits_cleanly(report: subprocess.CompletedProcess[str]) -> None:
    assert report.returncode == 0, report.stdout + report.stderr
    assert "Sanitizer" not in report.stderr, report.stderr


@pytest.mark.parametrize("case", [pytest.param(c, id=c.replace(" ", "-")) for c in CASES])
def test_each_case_passes(report: subprocess.CompletedProcess[str], case: str) -> None:
    assert f"ok {case}" in report.stdout.splitlines(), report.stdout


def c_reads(kit: Kit, path: Path) -> tuple[int, str]:
    proc = subprocess.run(
        [str(kit.build / "usage_test"), "dump", str(path)],
        env=kit.env(hooked=False),
        capture_output=True,
        text=True,
        check=False,
    )
    return proc.returncode, proc.stdout


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    stamp=st.integers(min_value=USAGE_MAX_WINDOW_US, max_value=2**63 - 1),
    window=st.integers(min_value=1, max_value=USAGE_MAX_WINDOW_US),
    used=st.integers(min_value=0, max_value=100),
    ceiling=st.integers(min_value=1, max_value=100),
)
def test_the_python_writer_and_the_c_reader_agree(
    stamp: int, window: int, used: int, ceiling: int
) -> None:
    kit = sanitized_kit()
    written = ShareUsage(stamp, window, used, ceiling)
    path = written.write_atomic(kit.root / "usage-agree")
    assert ShareUsage.parse(path.read_text()) == written
    assert c_reads(kit, path) == (0, f"{stamp} {window} {used} {ceiling}\n")


HOSTILE = {
    "empty": "",
    "no ceiling": "version=1\nstamp_us=5\nwindow_us=1\nused_percent=0\n",
    "version 2": "version=2\nstamp_us=5\nwindow_us=1\nused_percent=0\nceiling_percent=1\n",
    "ceiling 0": "version=1\nstamp_us=5\nwindow_us=1\nused_percent=0\nceiling_percent=0\n",
    "used 101": "version=1\nstamp_us=5\nwindow_us=1\nused_percent=101\nceiling_percent=1\n",
    "window past the epoch": (
        "version=1\nstamp_us=5\nwindow_us=6\nused_percent=0\nceiling_percent=1\n"
    ),
    "signed": "version=1\nstamp_us=+5\nwindow_us=1\nused_percent=0\nceiling_percent=1\n",
    "a key twice": (
        "version=1\nversion=1\nstamp_us=5\nwindow_us=1\nused_percent=0\nceiling_percent=1\n"
    ),
    "a limits key": (
        "version=1\nstamp_us=5\nwindow_us=1\nused_percent=0\nceiling_percent=1\ncompute_percent=5\n"
    ),
    "over the size bound": "#" * 600,
    "NUL": "version=1\nstamp_us=5\x00\nwindow_us=1\nused_percent=0\nceiling_percent=1\n",
    "no equals": "version=1\nstamp_us 5\nwindow_us=1\nused_percent=0\nceiling_percent=1\n",
}


@pytest.mark.parametrize("text", list(HOSTILE.values()), ids=list(HOSTILE))
def test_both_readers_refuse_a_hostile_file(tmp_path: Path, text: str) -> None:
    with pytest.raises(LimitsError):
        ShareUsage.parse(text)
    path = tmp_path / "usage"
    path.write_text(text)
    code, out = c_reads(sanitized_kit(), path)
    assert code == 2 and out.startswith("invalid"), out


@pytest.mark.parametrize(
    ("text", "why"),
    [
        pytest.param(HOSTILE["NUL"], "line 2: contains a NUL byte", id="nul"),
        pytest.param(HOSTILE["no equals"], "line 2: expected key=value", id="no-equals"),
        pytest.param(HOSTILE["signed"], "line 2: not an unsigned integer", id="signed"),
        pytest.param(
            "# written by the node agent\n\nversion=1\nversion=1\n",
            "line 4: expected one of its keys, once",
            id="comment-and-blank-lines-counted",
        ),
    ],
)
def test_the_c_reader_names_the_line_as_the_limits_reader_does(
    tmp_path: Path, text: str, why: str
) -> None:
    path = tmp_path / "usage"
    path.write_text(text)
    code, out = c_reads(sanitized_kit(), path)
    assert code == 2
    assert why in out


def test_the_limits_file_is_unchanged_for_an_older_hook(tmp_path: Path) -> None:
    # Byte for byte what the writer rendered before the usage file existed: a hook that reads
    # only `limits`, strictly, reads it as before, and the current C reader accepts it.
    path = Limits(("GPU-1",), 1 << 30, 30).write_atomic(tmp_path)
    assert path.read_text() == (
        "# written by the fracgpu device plugin; read by libfracgpu.so\n"
        "version=1\ndevices=GPU-1\nmemory_bytes=1073741824\ncompute_percent=30\n"
    )
    ShareUsage(10**15, 100_000, 20, 30).write_atomic(tmp_path)
    proc = subprocess.run(
        [str(sanitized_kit().build / "limits_dump"), str(path)],
        env=sanitized_kit().env(hooked=False),
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout
    assert "compute_percent=30" in proc.stdout
