"""The quota metrics as dashboards and alerts know them: names, help and labels must not drift.

The declarations are split by family (:class:`quota.metrics.QuotaMetrics`); this table pins every
metric of every family, and the order the registry lists them in.
"""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from quota.ledger import Ledger
from quota.metrics import QuotaMetrics
from quota.model import GPUQuota
from testkit.quota_pods import counted_quota

METRICS = [
    # usage: what each quota limits and charges
    pytest.param(
        "limit",
        Gauge,
        "fracgpu_quota_limit",
        "GPUQuota limits (resource: cards, memory_mib, pods), per namespace and quota.",
        ("namespace", "quota", "resource"),
        id="limit",
    ),
    pytest.param(
        "used",
        Gauge,
        "fracgpu_quota_used",
        "GPU a quota charges (counted pods plus admissions not yet seen as pods).",
        ("namespace", "quota", "resource"),
        id="used",
    ),
    pytest.param(
        "pending",
        Gauge,
        "fracgpu_quota_pending_admissions",
        "Admissions recorded one by one in a GPUQuota that the controller has not yet matched "
        "to pods (bounded by pending_limit; older ones are aggregated).",
        ("namespace", "quota"),
        id="pending",
    ),
    pytest.param(
        "unmatched_age",
        Gauge,
        "fracgpu_quota_unmatched_admission_age_seconds",
        "Age of the oldest admission not matched to a pod, once it is older than stale_after_s "
        "(0 otherwise): above 0, the quota controller is not running.",
        ("namespace", "quota"),
        id="unmatched_age",
    ),
    # decisions: what admission and the controller did
    pytest.param(
        "conflicts",
        Counter,
        "fracgpu_quota_cas_conflicts",
        "GPUQuota status writes refused with 409 Conflict (re-read and retried).",
        ("component",),
        id="conflicts",
    ),
    pytest.param(
        "first_counts",
        Counter,
        "fracgpu_quota_counted_by_admission",
        "GPUQuotas that a replica counted itself because pods waited on them and no controller "
        "had counted them (the leader crashed, or is slow).",
        (),
        id="first_counts",
    ),
    pytest.param(
        "admission",
        Histogram,
        "fracgpu_quota_admission_duration_seconds",
        "Time to decide quota for one GPU pod, reservation write included.",
        ("outcome",),
        id="admission",
    ),
    pytest.param(
        "decisions",
        Counter,
        "fracgpu_quota_decisions",
        "Quota decisions for GPU pods, by outcome and reason.",
        ("outcome", "reason"),
        id="decisions",
    ),
    pytest.param(
        "released",
        Counter,
        "fracgpu_quota_reservations_released",
        "Admissions the controller matched or dropped: confirmed (pod seen), expired (pod never "
        "persisted), ended (pod deleted or finished first), unmatched (the aggregate of older "
        "admissions, matched or expired), or denied (admission failed part-way and withdrew it).",
        ("why",),
        id="released",
    ),
    pytest.param(
        "reconciles",
        Counter,
        "fracgpu_quota_reconciles",
        "Controller passes over all GPUQuotas, by result.",
        ("result",),
        id="reconciles",
    ),
    # control: whether quota can work at all
    pytest.param(
        "leader",
        Gauge,
        "fracgpu_quota_leader",
        "1 while this replica holds the quota controller's Lease.",
        (),
        id="leader",
    ),
    pytest.param(
        "crd_installed",
        Gauge,
        "fracgpu_quota_crd_installed",
        "1 when the GPUQuota CRD is installed; 0 while it is not (GPU pods are denied).",
        (),
        id="crd_installed",
    ),
    pytest.param(
        "controller_seen",
        Gauge,
        "fracgpu_quota_controller_seen",
        "1 while this replica sees some replica hold the quota controller's Lease (renewed "
        "within its duration); 0 means no controller runs anywhere.",
        (),
        id="controller_seen",
    ),
    pytest.param(
        "lease_errors",
        Counter,
        "fracgpu_quota_lease_errors",
        "Lease requests that failed with something other than a lost race, by HTTP status (or "
        "'network'): 404 usually means the lease namespace does not exist, 403 RBAC.",
        ("code",),
        id="lease_errors",
    ),
    # forwarding: decisions sent to the leader
    pytest.param(
        "forwarded",
        Counter,
        "fracgpu_quota_forwarded",
        "Quota decisions this replica sent to the leader, by outcome: 'answered', or 'fallback' "
        "when the leader could not be reached and this replica decided itself.",
        ("outcome",),
        id="forwarded",
    ),
    pytest.param(
        "decided_for_peers",
        Counter,
        "fracgpu_quota_decided_for_peers",
        "Quota decisions this replica made for another replica that forwarded them.",
        (),
        id="decided_for_peers",
    ),
]


@pytest.mark.parametrize(("attribute", "kind", "name", "help_text", "labels"), METRICS)
def test_every_metric_keeps_its_name_help_and_labels(
    attribute: str, kind: type, name: str, help_text: str, labels: tuple[str, ...]
) -> None:
    metric = getattr(QuotaMetrics(CollectorRegistry()), attribute)
    assert type(metric) is kind
    assert metric._name == name
    assert metric._documentation == help_text
    assert metric._labelnames == labels


def test_the_registry_lists_the_families_in_declaration_order() -> None:
    registry = CollectorRegistry()
    QuotaMetrics(registry)
    listed = [family.name for family in registry.collect()]
    assert listed == [param.values[2] for param in METRICS]


@pytest.mark.parametrize(
    ("resource", "limit", "used"),
    [
        pytest.param("cards", 2.0, 0.0, id="cards-in-whole-cards"),
        pytest.param("memory_mib", None, 0.0, id="memory-unlimited-has-no-limit-series"),
        pytest.param("pods", 3.0, 0.0, id="pods"),
    ],
)
def test_observe_publishes_one_quota_and_forget_removes_it(
    resource: str, limit: float | None, used: float
) -> None:
    registry = CollectorRegistry()
    metrics = QuotaMetrics(registry)
    quota = GPUQuota(counted_quota(gpu=2, pods=3))
    metrics.observe(Ledger.of(quota))
    labels = {"namespace": "team-a", "quota": "team-a", "resource": resource}
    assert registry.get_sample_value("fracgpu_quota_limit", labels) == limit
    assert registry.get_sample_value("fracgpu_quota_used", labels) == used
    metrics.unmatched_age.labels("team-a", "team-a").set(5.0)
    metrics.forget("team-a", "team-a")
    assert registry.get_sample_value("fracgpu_quota_used", labels) is None
    pending = {"namespace": "team-a", "quota": "team-a"}
    assert registry.get_sample_value("fracgpu_quota_pending_admissions", pending) is None
    age = "fracgpu_quota_unmatched_admission_age_seconds"
    assert registry.get_sample_value(age, pending) is None
