"""The node guard benchmark runs end to end and reports every figure it promises.

Timings themselves are the benchmark's business (``python -m bench.guard``); this only checks
that one small run measures each path (a kill the guard did not make would raise).
"""

from __future__ import annotations

import json

import pytest

from bench import guard as bench


def test_one_sample_of_each(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--samples", "1", "--processes", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    counts = {
        key: value["n"] for key, value in report.items() if isinstance(value, dict) and "n" in value
    }
    assert counts == {
        "excess_to_reported": 1,
        "excess_to_killed": 1,
        "excess_to_reported_grace_0": 1,
        "excess_to_killed_grace_0": 1,
        "baseline_nvml_read_and_kill": 1,
    }
    assert set(report["scan_with_2_processes"]) == {"p50_ms", "p99_ms"}
