"""``fracgpu quota``: the view from a quota file and from the fake API server."""

import argparse
import asyncio
from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml

from core import dra
from quota.cli import add_parser
from quota.demand import Demand
from quota.ledger import Ledger
from quota.model import GPUQuota
from quota.offline import review_pods
from quota.report import render
from testkit.apiserver import FakeApiServer
from testkit.quota_pods import gpu_pod, gpu_quota


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    return parser


def test_file_view(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "q.yaml"
    quota = gpu_quota(gpu="4", gpumem="64Gi", models={"A100": {"gpu": 2}})
    quota["status"] = {"used": {"core": 150, "memoryMiB": 8192, "pods": 2}}
    path.write_text(yaml.safe_dump(quota))
    args = _parser().parse_args(["quota", "--file", str(path), "-n", "team-a"])
    assert args.run(args) == 0
    out = capsys.readouterr().out
    assert "CARDS USED/LIMIT" in out
    assert "1.50/4.00" in out
    assert "8192/65536" in out
    assert "model A100" in out
    missing = _parser().parse_args(["quota", "--file", str(tmp_path / "none.yaml")])
    assert missing.run(missing) == 1


def test_render_lists_pods_and_pending() -> None:
    quota = GPUQuota(gpu_quota(gpu=2))
    pods = [gpu_pod("train", 100, 8), gpu_pod("done", 50, 4)]
    pods[1]["status"] = {"phase": "Succeeded"}
    out = render([quota], {"team-a": pods})
    assert "  train  1.00 card, 2048 MiB" in out
    assert "done" not in out
    assert render([], {}) == "No GPUQuotas found.\n"


async def test_cluster_view(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    async with FakeApiServer(namespaces=("default", "team-a")) as fake:
        fake.put(gpu_quota(gpu=2))
        fake.put(gpu_pod("train", 100, 8))
        kubeconfig = fake.kubeconfig(tmp_path / "kubeconfig")
        args = _parser().parse_args(["quota", "-A", "--kubeconfig", str(kubeconfig)])
        code = await asyncio.to_thread(args.run, args)
    assert code == 0
    out = capsys.readouterr().out
    assert "team-a" in out
    assert "  train  1.00 card, 2048 MiB" in out


def test_offline_decisions_feed_the_view(tmp_path: Path) -> None:
    path = tmp_path / "q.yaml"
    path.write_text(yaml.safe_dump(gpu_quota(gpu=1)))
    assert [d.allowed for d in review_pods(path, [gpu_pod("a", 60), gpu_pod("b", 60)])] == [
        True,
        False,
    ]


def test_render_lists_pending_admissions_and_the_unmatched_rest() -> None:
    quota = GPUQuota(gpu_quota(gpu=2))
    ledger = Ledger.of(quota, pending_limit=1)
    at = datetime(2026, 1, 1, tzinfo=UTC)
    ledger.admit("u1", "early", Demand(30, 256), at)
    ledger.admit("u2", "late", Demand(20, 256), at)
    out = render([quota.with_status(ledger.status(quota.status))], {"team-a": []})
    assert "0.50/2.00" in out
    assert "  late  0.20 card, 256 MiB  (pending)" in out
    assert "  and 1 more admitted pods not yet seen by the controller  0.30 card, 256 MiB" in out


@pytest.mark.parametrize("output", ["json", "yaml"])
def test_the_view_as_objects(
    output: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "q.yaml"
    quota = gpu_quota(gpu="4", gpumem="64Gi", models={"A100": {"gpu": 2}})
    quota["status"] = {"used": {"core": 150, "memoryMiB": 8192, "pods": 2}}
    path.write_text(yaml.safe_dump(quota))
    args = _parser().parse_args(["quota", "--file", str(path), "-n", "team-a", "-o", output])
    assert args.run(args) == 0
    (shown,) = yaml.safe_load(capsys.readouterr().out)  # JSON is YAML too
    assert shown["used"] == {"cards": "1.50", "memoryMiB": 8192, "pods": 2}
    assert shown["limit"] == {"cards": "4.00", "memoryMiB": 65536, "pods": None}
    assert shown["models"]["A100"]["limit"]["cards"] == "2.00"


async def test_cluster_view_lists_pods_whose_share_is_in_their_claims(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """DRA mode: the pod's containers carry no fracgpu resource, its claim does; the view reads
    the claim, as the quota controller does, and lists the pod with what it holds."""
    async with FakeApiServer(namespaces=("default", "team-a")) as fake:
        fake.put(gpu_quota(gpu=2))
        fake.put({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
            "metadata": {"name": "fracgpu-c30-m2048", "namespace": "team-a"},
            "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                "deviceClassName": dra.DEVICE_CLASS, "count": 1,
                "capacity": {"requests": {"cores": "30", "memory": "2048Mi"}}}}]}}},
        })  # fmt: skip
        fake.put({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "notebook", "namespace": "team-a", "uid": "u-1"},
            "spec": {
                "resourceClaims": [{"name": "gpu",
                                    "resourceClaimTemplateName": "fracgpu-c30-m2048"}],
                "containers": [{"name": "main", "image": "x",
                                "resources": {"claims": [{"name": "gpu"}]}}],
            },
        })  # fmt: skip
        kubeconfig = fake.kubeconfig(tmp_path / "kubeconfig")
        args = _parser().parse_args(["quota", "-n", "team-a", "--kubeconfig", str(kubeconfig)])
        code = await asyncio.to_thread(args.run, args)
    assert code == 0
    out = capsys.readouterr().out
    assert "  notebook  0.30 card, 2048 MiB" in out
    assert "no GPU pods" not in out
