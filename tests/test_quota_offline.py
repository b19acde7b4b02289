"""``fracgpu review --quota FILE``: decisions for a list of pods, in order."""

from pathlib import Path

import pytest
import yaml

from quota.model import QuotaError
from quota.offline import review_pods
from quota.store import load_quota_file
from testkit.quota_pods import gpu_pod, gpu_quota, plain_pod


def _file(tmp_path: Path, *objects: object) -> Path:
    path = tmp_path / "quota.yaml"
    path.write_text(yaml.safe_dump_all(objects))
    return path


def test_pods_in_order(tmp_path: Path) -> None:
    path = _file(tmp_path, gpu_quota(gpu="1.5", gpumem="16Gi"))
    pods = [gpu_pod(f"p{i}", 50, 16) for i in range(4)] + [plain_pod("cpu")]
    pods.append(gpu_pod("elsewhere", 800, 32, namespace="team-b"))
    decisions = review_pods(path, pods)
    assert [d.allowed for d in decisions] == [True, True, True, False, True, True]
    assert decisions[3].message == (
        'GPU quota exceeded in namespace "team-a": this pod asks 0.50 card and 4096 MiB; '
        'quota "team-a" allows 1.50 cards (1.50 used) and 16384 MiB (12288 used)'
    )
    assert decisions[4].reason == "no-gpu"
    assert decisions[5].reason == "no-quota"
    assert not review_pods(path, pods[-1:], require_quota=True)[0].allowed


def test_bad_file(tmp_path: Path) -> None:
    with pytest.raises(QuotaError, match=r'GPUQuota "team-a/team-a": spec.gpu'):
        load_quota_file(_file(tmp_path, gpu_quota(gpu="0.001")))
    with pytest.raises(QuotaError, match="every document must be a GPUQuota"):
        load_quota_file(_file(tmp_path, plain_pod("x")))
