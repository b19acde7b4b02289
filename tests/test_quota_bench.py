"""bench.quota's real-cluster path (--kubeconfig), run against the fake API server: it creates
its namespaces, quotas and pods through the real client, reports, and cleans up."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import quota as bench
from testkit.apiserver import FakeApiServer


async def test_cluster_mode_runs_and_cleans_up(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async with FakeApiServer() as fake:
        fake.register(bench.RESOURCEQUOTA)
        kubeconfig = fake.kubeconfig(tmp_path / "kubeconfig")
        args = bench.parser().parse_args(
            [
                "--kubeconfig",
                str(kubeconfig),
                "--serial",
                "3",
                "--pods",
                "10",
                "--concurrency",
                "4",
                "--rounds",
                "1",
                "--gpu",
                "1",
                "--settle-s",
                "0.1",
            ]
        )
        # The fake enforces no quota: all 10 pods are created where 9 fit, and the benchmark
        # says so and fails, as it would on a cluster whose quota let one too many in.
        assert await bench.cluster(args) == 1
        namespaces = {n["metadata"]["name"] for n in fake.objects("namespaces")}
    out = capsys.readouterr().out
    assert "fracgpu / resourcequota, median of the rounds: latency one at a time" in out
    assert "over-admission: 1 (fracgpu admitted 10 of 10, 9 fit" in out
    assert not any(name.startswith("bench-") for name in namespaces)


def test_local_mode_runs_both_cases_through_replica_processes() -> None:
    """The local comparison as documented: the fake API server and two webhook replicas in
    processes of their own, the replicas electing a leader and forwarding to it; nothing is
    over-admitted and the report has both ratios. (Figures are the benchmark's business.)"""
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "bench.quota", "--rounds", "1", "--serial", "3", "--pods", "40"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "over-admission: 0 (fracgpu admitted 36 of 40, 36 fit; resourcequota admitted 36)" in (
        result.stdout
    )
    assert "throughput in flight" in result.stdout
