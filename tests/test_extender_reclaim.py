"""Reclaim frees a booking only on R1-R3 (deleted, bound elsewhere, ended); never for a pod
that is pending and unbound, and never for one that cannot be read."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from typing import Any

import pytest

from core.informer import Informers
from core.placement import ContainerPlacement
from extender.ledger import Booking, Ledger, to_object
from extender.ledgerstore import MemoryLedgerStore
from extender.pods import PodApiDown
from extender.reclaim import evidence, reclaim_node
from extender.service import ExtenderConfig, ExtenderService
from testkit.apiserver import FakeApiServer
from testkit.extender import Gpu, node, pod
from testkit.kinds import GPUNODELEDGER


def with_phase(obj: dict[str, Any], phase: str) -> dict[str, Any]:
    return {**obj, "status": {"phase": phase}}


EVIDENCE = [
    pytest.param(None, "R1: the pod was deleted", id="404"),
    pytest.param(pod("a", (50, 8), uid="other"), "R1: the pod was deleted (its name", id="new UID"),
    pytest.param(pod("a", (50, 8), node_name="n2"), "R2: the pod is bound to node n2", id="R2"),
    pytest.param(
        with_phase(pod("a", (50, 8), node_name="n1"), "Succeeded"),
        "R3: the pod has succeeded",
        id="succeeded",
    ),
    pytest.param(
        with_phase(pod("a", (50, 8), node_name="n1"), "Failed"),
        "R3: the pod has failed",
        id="failed",
    ),
    pytest.param(pod("a", (50, 8)), None, id="pending and unbound: kept (R4)"),
    pytest.param(pod("a", (50, 8), node_name="n1"), None, id="bound here: kept"),
    pytest.param(
        with_phase(pod("a", (50, 8), node_name="n1"), "Running"), None, id="running here: kept"
    ),
]


@pytest.mark.parametrize(("obj", "why"), EVIDENCE)
def test_evidence(obj: dict[str, Any] | None, why: str | None) -> None:
    found = evidence("uid-a", "n1", obj)
    if why is None:
        assert found is None
    else:
        assert found is not None and found.startswith(why)


class Pods:
    """Pods by name; a name in ``down`` cannot be read."""

    def __init__(self, pods: list[dict[str, Any]], down: frozenset[str] = frozenset()) -> None:
        self.pods = {p["metadata"]["name"]: p for p in pods}
        self.down = down

    async def get(self, namespace: str, name: str) -> dict[str, Any] | None:
        if name in self.down:
            raise PodApiDown("unreachable")
        return self.pods.get(name)

    async def bind(
        self, namespace: str, name: str, uid: str, node: str, annotations: Mapping[str, str]
    ) -> None:
        raise AssertionError("reclaim never binds")


def booked(*names: str) -> Ledger:
    share = {"c0": ContainerPlacement(("GPU-0",), 10, 1)}
    return Ledger("n1", {f"uid-{n}": Booking("team", n, share) for n in names})


async def test_a_pass_frees_only_what_has_evidence() -> None:
    store = MemoryLedgerStore()
    await store.create(booked("gone", "moved", "done", "waiting", "running", "unreadable"))
    pods = Pods(
        [
            pod("moved", (10, 1), node_name="n2"),
            with_phase(pod("done", (10, 1), node_name="n1"), "Succeeded"),
            pod("waiting", (10, 1)),
            with_phase(pod("running", (10, 1), node_name="n1"), "Running"),
            pod("unreadable", (10, 1), uid="whatever"),
        ],
        down=frozenset({"unreadable"}),
    )
    freed = await reclaim_node(store, pods, "n1")
    assert sorted(freed) == ["uid-done", "uid-gone", "uid-moved"]
    ledger = await store.get("n1")
    assert ledger is not None
    assert sorted(ledger.bookings) == ["uid-running", "uid-unreadable", "uid-waiting"]
    assert await reclaim_node(store, pods, "n1") == {}  # idempotent: nothing more to free


async def test_no_ledger_nothing_to_do() -> None:
    assert await reclaim_node(MemoryLedgerStore(), Pods([]), "n1") == {}


async def test_filter_answers_only_after_the_first_pass_released_what_no_extender_saw_go() -> None:
    """A booking whose pod went while no extender ran (an upgrade, a reinstall) is released by
    the first reclaim pass, once the ledgers are listed; until that pass ends the service is
    not ready, so filter answers an error the scheduler retries within seconds instead of
    rejecting pods for room the stale booking holds."""
    stale = booked("gone")
    async with FakeApiServer(namespaces=("team",)) as fake:
        fake.register(GPUNODELEDGER)
        fake.put(node("n1", Gpu("GPU-0")))
        fake.put(to_object(stale))
        async with fake.api_client() as api:
            informers = Informers(api)
            service = ExtenderService(api, informers, ExtenderConfig(enabled=True))
            assert not service.ready()
            task = asyncio.create_task(service.run())
            try:
                for _ in range(200):
                    if service.ready():
                        break
                    await asyncio.sleep(0.01)
                assert service.ready()
                stored = fake.get("gpunodeledgers", "n1")
                assert stored is not None and stored["spec"].get("bookings", {}) == {}
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
