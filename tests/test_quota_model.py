"""GPUQuota objects: spec parsing with messages that name the quota and the field."""

import pytest

from quota.model import GPUQuota, QuotaError, QuotaStatus
from testkit.quota_pods import gpu_quota


def test_spec_in_canonical_units() -> None:
    quota = GPUQuota(gpu_quota(gpu="4.5", gpumem="64Gi", pods=10, models={"A100": {"gpu": 2}}))
    assert (quota.spec.gpu, quota.spec.gpumem, quota.spec.pods) == (450, 65536, 10)
    assert quota.spec.models["A100"].gpu == 200
    assert quota.spec.models["A100"].gpumem is None


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ({"gpu": "4.555"}, 'GPUQuota "team-a/team-a": spec.gpu must be a number of cards'),
        ({"gpumem": "64G"}, "spec.gpumem must be GPU memory as a whole number of MiB"),
        ({"gpu": 1, "gpumme": 3}, "spec.gpumme is not a GPUQuota field"),
        ({"models": {"A100": {"gpu": "x"}}}, "spec.models.A100.gpu must be a number of cards"),
        ({}, "spec limits nothing; set at least one of gpu, gpumem, pods or models"),
        ({"pods": -1}, "spec.pods must be a whole number of pods"),
    ],
    ids=[
        "three decimals",
        "decimal giga memory",
        "a misspelt field",
        "a model's cards not a number",
        "limits nothing",
        "negative pods",
    ],
)
def test_invalid_spec(spec: dict[str, object], expected: str) -> None:
    with pytest.raises(QuotaError, match=expected.replace(".", r"\.")):
        GPUQuota(gpu_quota(**spec))


def test_status_round_trip_keeps_unknown_fields() -> None:
    raw = gpu_quota(gpu=4)
    raw["metadata"]["labels"] = {"team": "a"}
    quota = GPUQuota(raw)
    status = QuotaStatus.model_validate(
        {"used": {"cards": "1.00", "core": 100, "memoryMiB": 8192, "pods": 1}}
    )
    written = quota.with_status(status)
    assert written.raw["metadata"]["labels"] == {"team": "a"}
    assert written.raw["status"]["used"]["memoryMiB"] == 8192
    assert GPUQuota(written.raw).status.used.core == 100
