"""The hook's bottom layer on its own (native/src/real.c and log.c): the C unit tests of the table
of real entry points, resolved from the fake driver and NVML, and of the log line. Built with the
sanitizers in the session's native kit, each must report every case ok."""

from __future__ import annotations

import subprocess

import pytest

from testkit.native_kit import sanitized_kit

# Each unit test binary, the arguments it needs beside the build, and its cases in order.
UNITS: dict[str, tuple[tuple[str, ...], list[str]]] = {
    "real_test": (
        ("fake/libcuda.so.1", "fake/libnvidia-ml.so.1"),
        [
            "every name once, in a slot of its own",
            "driver names resolve from libcuda, nvml names from NVML",
            "each library fills its own slots only",
            "a library without the names leaves their slots empty",
        ],
    ),
    "log_test": (
        (),
        [
            "a line with the prefix",
            "an empty message is the prefix alone",
            "a percent sign in an argument is text",
            "a long message is cut to 511 bytes, newline kept",
        ],
    ),
}


@pytest.fixture(scope="module")
def reports() -> dict[str, subprocess.CompletedProcess[str]]:
    kit = sanitized_kit()
    return {
        unit: subprocess.run(
            [str(kit.build / unit), *(str(kit.build / a) for a in args)],
            env=kit.env(hooked=False),
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        for unit, (args, _) in UNITS.items()
    }


@pytest.mark.parametrize("unit", list(UNITS))
def test_the_unit_test_exits_cleanly(
    reports: dict[str, subprocess.CompletedProcess[str]], unit: str
) -> None:
    report = reports[unit]
    assert report.returncode == 0, report.stdout + report.stderr
    assert "Sanitizer" not in report.stderr, report.stderr


@pytest.mark.parametrize(
    ("unit", "case"),
    [
        pytest.param(unit, case, id=f"{unit}-{case.replace(' ', '-')}")
        for unit, (_, cases) in UNITS.items()
        for case in cases
    ],
)
def test_each_case_passes(
    reports: dict[str, subprocess.CompletedProcess[str]], unit: str, case: str
) -> None:
    assert f"ok {case}" in reports[unit].stdout.splitlines(), reports[unit].stdout


@pytest.mark.parametrize("unit", list(UNITS))
def test_no_case_fails(reports: dict[str, subprocess.CompletedProcess[str]], unit: str) -> None:
    printed = [line for line in reports[unit].stdout.splitlines() if line.startswith("ok ")]
    assert printed == [f"ok {case}" for case in UNITS[unit][1]], reports[unit].stdout
