"""The scheduler's Lease decides whether GPU pods are handed to it: its states, a fake clock,
and the real client following the Lease through the fake API server."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from testkit.apiserver import FakeApiServer
from tests.support import eventually
from webhook.config import AdmissionConfig
from webhook.inventory import Inventory
from webhook.mutation import Mutator
from webhook.schedwatch import SchedulerPresence, scheduler_informer

NOW = 1_800_000_000.0


def stamp(seconds: float) -> str:
    return (
        datetime.fromtimestamp(seconds, UTC)
        .isoformat(timespec="microseconds")
        .replace("+00:00", "Z")
    )


def lease(name: str = "fracgpu-scheduler", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": name, "namespace": "fracgpu"},
        "spec": spec,
    }


FRESH = {"holderIdentity": "s-1", "leaseDurationSeconds": 15, "renewTime": stamp(NOW - 2)}


@pytest.mark.parametrize(
    ("event", "why"),
    [
        pytest.param(None, "its Lease fracgpu/fracgpu-scheduler does not exist", id="never-seen"),
        pytest.param(("ADDED", lease(**FRESH)), None, id="renewed-2s-ago"),
        pytest.param(
            ("MODIFIED", lease(**{**FRESH, "renewTime": stamp(NOW - 24)})),
            None,
            id="late-within-slack",
        ),
        pytest.param(
            ("MODIFIED", lease(**{**FRESH, "renewTime": stamp(NOW - 95)})),
            "its Lease fracgpu/fracgpu-scheduler was last renewed 95 s ago",
            id="stale",
        ),
        pytest.param(
            (
                "MODIFIED",
                lease(**{**FRESH, "leaseDurationSeconds": 120, "renewTime": stamp(NOW - 95)}),
            ),
            None,
            id="long-lease",
        ),
        pytest.param(
            ("MODIFIED", lease(**{**FRESH, "holderIdentity": ""})),
            "its Lease fracgpu/fracgpu-scheduler has no holder",
            id="released",
        ),
        pytest.param(
            ("MODIFIED", lease(**{**FRESH, "renewTime": "yesterday"})),
            "its Lease fracgpu/fracgpu-scheduler has never been renewed",
            id="unreadable-time",
        ),
        pytest.param(
            ("DELETED", lease(**FRESH)),
            "its Lease fracgpu/fracgpu-scheduler does not exist",
            id="deleted",
        ),
        pytest.param(
            ("ADDED", lease("other", **FRESH)),
            "its Lease fracgpu/fracgpu-scheduler does not exist",
            id="another-lease",
        ),
    ],
)
def test_presence(event: tuple[Any, dict[str, Any]] | None, why: str | None) -> None:
    presence = SchedulerPresence("fracgpu/fracgpu-scheduler", clock=lambda: NOW)
    if event is not None:
        presence.on_event(*event)
    assert presence.not_running() == why


def gpu_pod() -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p"},
        "spec": {
            "containers": [{"name": "c", "resources": {"limits": {"fracgpu.io/gpu": "1"}}}],
            "schedulerName": "default-scheduler",
        },
    }


def test_pods_are_handed_to_the_scheduler_only_while_it_runs() -> None:
    presence = SchedulerPresence("fracgpu/fracgpu-scheduler", clock=lambda: NOW)
    m = Mutator(AdmissionConfig(scheduler_name="fracgpu-scheduler"), Inventory(), presence)
    down = m.mutate(gpu_pod(), "", "Pod")
    assert [op for op in down.patch if op["path"] == "/spec/schedulerName"] == []
    assert down.warnings == [
        "scheduler fracgpu-scheduler is not running (its Lease fracgpu/fracgpu-scheduler does "
        "not exist); the pod keeps default-scheduler so that it does not wait unscheduled"
    ]
    presence.on_event("ADDED", lease(**FRESH))
    up = m.mutate(gpu_pod(), "", "Pod")
    assert {
        "op": "replace",
        "path": "/spec/schedulerName",
        "value": "fracgpu-scheduler",
    } in up.patch


def test_templates_never_carry_the_scheduler() -> None:
    """A template's value would outlive the scheduler; each pod is decided when created."""
    presence = SchedulerPresence("fracgpu/fracgpu-scheduler", clock=lambda: NOW)
    presence.on_event("ADDED", lease(**FRESH))
    m = Mutator(AdmissionConfig(scheduler_name="fracgpu-scheduler"), Inventory(), presence)
    deploy = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "d"},
        "spec": {"template": {"metadata": {}, "spec": gpu_pod()["spec"]}},
    }
    outcome = m.mutate(deploy, "apps", "Deployment")
    assert [op for op in outcome.patch if "schedulerName" in op["path"]] == []


def test_without_a_watch_the_configuration_is_trusted() -> None:
    """``fracgpu review`` has no cluster: it shows what a running scheduler would get."""
    m = Mutator(AdmissionConfig(scheduler_name="fracgpu-scheduler"), Inventory())
    outcome = m.mutate(gpu_pod(), "", "Pod")
    assert {"op": "replace", "path": "/spec/schedulerName", "value": "fracgpu-scheduler"} in (
        outcome.patch
    )


@pytest.mark.parametrize(
    "value",
    [
        pytest.param("fracgpu", id="no-slash"),
        pytest.param("a/b/c", id="two-slashes"),
        pytest.param("/x", id="no-namespace"),
    ],
)
def test_lease_must_be_namespace_slash_name(value: str) -> None:
    with pytest.raises(ValueError, match="write the Lease as namespace/name"):
        AdmissionConfig(scheduler_lease=value)


async def test_presence_follows_the_lease_through_the_api() -> None:
    async with FakeApiServer(namespaces=("default", "fracgpu")) as fake, fake.api_client() as api:
        presence = SchedulerPresence("fracgpu/fracgpu-scheduler")
        async with scheduler_informer(api, presence) as informer:
            await informer.wait_synced(5)
            assert presence.not_running() == "its Lease fracgpu/fracgpu-scheduler does not exist"
            fresh = {**FRESH, "renewTime": stamp(datetime.now(UTC).timestamp())}
            fake.put(lease(**fresh))
            await eventually(lambda: presence.not_running() is None)
            fake.remove("leases", "fracgpu-scheduler", "fracgpu")
            await eventually(lambda: presence.not_running() is not None)
