"""What the watches leave for the usage controller's next pass (quota.intake), event by event."""

from __future__ import annotations

from typing import Any

import pytest

from quota.claims import ClaimSpecs
from quota.demand import Demand, pod_demand
from quota.intake import EventIntake
from testkit.quota_pods import counted_quota, gpu_pod, gpu_quota, plain_pod


class Forgotten(list[tuple[str, str, str]]):
    def __call__(self, namespace: str, name: str, uid: str) -> None:
        self.append((namespace, name, uid))


def _intake(deleted_memory: int = 10) -> tuple[EventIntake, Forgotten]:
    forgotten = Forgotten()
    return EventIntake(forgotten, deleted_memory=deleted_memory), forgotten


GPU = gpu_pod("gpu", uid="u-gpu")
PLAIN = plain_pod("plain")
PLAIN["metadata"]["uid"] = "u-plain"
MISSING_CLAIM = gpu_pod("claims", uid="u-claims")
MISSING_CLAIM["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimName": "absent"}]
MISSING_CLAIM["spec"]["containers"][0]["resources"]["claims"] = [{"name": "gpu"}]


@pytest.mark.parametrize(
    ("kind", "pod", "dirty", "demand", "deleted"),
    [
        pytest.param("ADDED", GPU, {"team-a"}, pod_demand(GPU), False, id="gpu-pod-added"),
        pytest.param("MODIFIED", GPU, {"team-a"}, pod_demand(GPU), False, id="gpu-pod-changed"),
        pytest.param("DELETED", GPU, {"team-a"}, "absent", True, id="gpu-pod-deleted"),
        pytest.param("ADDED", PLAIN, set(), None, False, id="plain-pod-remembered-as-no-gpu"),
        pytest.param("DELETED", PLAIN, set(), "absent", False, id="plain-pod-deleted"),
    ],
)
def test_pod_events(
    kind: str,
    pod: dict[str, Any],
    dirty: set[str],
    demand: Demand | str | None,
    deleted: bool,
) -> None:
    intake, _ = _intake()
    uid = pod["metadata"]["uid"]
    intake.demands[uid] = Demand(1, 1)  # what an earlier event said
    intake.on_pod(kind, pod)
    assert intake.dirty == dirty
    assert intake.wake.is_set() is bool(dirty)
    assert intake.demands.get(uid, "absent") == demand
    assert (uid in intake.deleted) is deleted


def test_a_pod_whose_claims_are_not_read_is_sized_at_the_recount() -> None:
    claims = ClaimSpecs(None)  # reads nothing: every claim is missing
    intake = EventIntake(Forgotten(), claims=claims)
    intake.demands["u-claims"] = Demand(1, 1)
    intake.on_pod("ADDED", MISSING_CLAIM)
    demand = pod_demand(MISSING_CLAIM, claims=claims)
    assert demand is not None
    assert demand.missing_claims
    assert "u-claims" not in intake.demands
    assert intake.dirty == {"team-a"}


def test_deleted_pods_are_remembered_up_to_the_bound_oldest_first_out() -> None:
    intake, _ = _intake(deleted_memory=2)
    for index in range(3):
        intake.on_pod("DELETED", gpu_pod(f"p{index}", uid=f"u{index}"))
    assert list(intake.deleted) == ["u1", "u2"]


def _uncounted() -> dict[str, Any]:
    return gpu_quota(gpu=1)


def _with_pending() -> dict[str, Any]:
    raw = counted_quota(gpu=1)
    raw["status"]["pending"] = [
        {"uid": "u", "pod": "p", "core": 10, "memoryMiB": 64, "at": "2026-01-01T00:00:00Z"}
    ]
    return raw


def _unreadable() -> dict[str, Any]:
    raw = counted_quota(gpu=1)
    raw["status"]["used"] = "not a usage"
    return raw


@pytest.mark.parametrize(
    ("raw", "dirty", "urgent"),
    [
        pytest.param(_uncounted(), {"team-a"}, {"team-a"}, id="new-quota-is-urgent"),
        pytest.param(_unreadable(), {"team-a"}, {"team-a"}, id="unreadable-status-is-urgent"),
        pytest.param(_with_pending(), {"team-a"}, set(), id="pending-admissions-to-match"),
        pytest.param(counted_quota(gpu=1), set(), set(), id="counted-and-settled-is-quiet"),
    ],
)
def test_quota_events(raw: dict[str, Any], dirty: set[str], urgent: set[str]) -> None:
    intake, forgotten = _intake()
    intake.on_quota("MODIFIED", raw)
    assert intake.dirty == dirty
    assert intake.urgent == urgent
    assert forgotten == []


def test_a_deleted_quota_is_forgotten_and_marks_nothing() -> None:
    intake, forgotten = _intake()
    raw = _uncounted()
    raw["metadata"]["uid"] = "q1"
    intake.on_quota("DELETED", raw)
    assert forgotten == [("team-a", "team-a", "q1")]
    assert intake.dirty == set()


def test_take_hands_over_the_marks_and_starts_afresh() -> None:
    intake, _ = _intake()
    intake.on_quota("ADDED", _uncounted())
    intake.mark("team-b")
    assert intake.take() == ({"team-a", "team-b"}, {"team-a"})
    assert not intake.wake.is_set()
    assert intake.take() == (set(), set())
