"""The hook's record table (native/src/rectable.c) on its own: its C unit test, built with the
sanitizers in the session's native kit, must report every case ok."""

from __future__ import annotations

import subprocess

import pytest

from testkit.native_kit import sanitized_kit

CASES = [
    "colliding keys",
    "kind is part of the key",
    "delete from the middle of a probe chain",
    "delete from the middle of a chain that wraps",
    "growth 16 -> 32 -> 64 and beyond",
    "reset after fork",
    "take each matching record",
    "8 threads put and take",
]


@pytest.fixture(scope="module")
def report() -> subprocess.CompletedProcess[str]:
    kit = sanitized_kit()
    return subprocess.run(
        [str(kit.build / "rectable_test")],
        env=kit.env(hooked=False),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_unit_test_exits_cleanly(report: subprocess.CompletedProcess[str]) -> None:
    assert report.returncode == 0, report.stdout + report.stderr


def test_the_sanitizers_report_nothing(report: subprocess.CompletedProcess[str]) -> None:
    assert "Sanitizer" not in report.stderr, report.stderr


@pytest.mark.parametrize("case", [pytest.param(c, id=c.replace(" ", "-")) for c in CASES])
def test_each_case_passes(report: subprocess.CompletedProcess[str], case: str) -> None:
    assert f"ok {case}" in report.stdout.splitlines(), report.stdout
