"""deviceplugin/classic/policies.py: a device-plugin share's compute policy, from its pod's
annotation through the API server, never waited for, a hard cap until and unless it is known."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from core.contract import Limits
from core.kube import kube_client
from core.policy import HARD_CAP, POLICY_ANNOTATION, Priority, SharePolicy
from deviceplugin.classic.policies import PodPolicies
from deviceplugin.shared.apiloop import ApiCall
from deviceplugin.shared.guardtypes import Owner
from testkit.apiserver import DEFAULT_NAMESPACES, FakeApiServer

UID = "9b1c2d3e-0000-4000-8000-000000000001"
LIMITS = Limits(("GPU-0",), 1 << 30, 30)


def owner(container: str = "main", uid: str = UID) -> Owner:
    return Owner("team-a", "infer", container, uid, "c1", LIMITS, "/grants/c1")


def pod(annotations: dict[str, str] | None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "infer", "namespace": "team-a", "uid": UID}
    if annotations is not None:
        meta["annotations"] = annotations
    spec = {"containers": [{"name": "main", "image": "x"}]}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[tuple[FakeApiServer, Any]]:
    async with (
        FakeApiServer(namespaces=(*DEFAULT_NAMESPACES, "team-a")) as fake,
        kube_client(fake.kubeconfig(tmp_path / "kubeconfig")) as client,
    ):
        yield fake, client


class Spawner:
    """The agent's API loop, here the test's own: calls run as tasks of the running loop."""

    def __init__(self, api: Any) -> None:
        self.api = api
        self.calls = 0
        self.futures: list[concurrent.futures.Future[Any]] = []

    def __call__(self, call: ApiCall[Any]) -> concurrent.futures.Future[Any]:
        self.calls += 1
        future = asyncio.run_coroutine_threadsafe(_run(call, self.api), asyncio.get_running_loop())
        self.futures.append(future)
        return future

    async def settled(self) -> None:
        await asyncio.gather(
            *(asyncio.wrap_future(f) for f in self.futures), return_exceptions=True
        )


async def _run(call: ApiCall[Any], api: Any) -> Any:
    return await call(api)


POLICY = '{"main":{"ceiling":100,"priority":"high"},"side":{"priority":"low","ceiling":60}}'


@pytest.mark.parametrize(
    ("annotations", "who", "expected"),
    [
        pytest.param({POLICY_ANNOTATION: POLICY}, owner(), SharePolicy(100, Priority.HIGH),
                     id="its-containers-policy"),
        pytest.param({POLICY_ANNOTATION: POLICY}, owner("side"), SharePolicy(60),
                     id="another-container-of-the-pod"),
        pytest.param({POLICY_ANNOTATION: POLICY}, owner("sidecar"), HARD_CAP,
                     id="a-container-not-named-is-a-hard-cap"),
        pytest.param(None, owner(), HARD_CAP, id="no-annotation-a-hard-cap"),
        pytest.param({POLICY_ANNOTATION: POLICY}, owner(uid="another-uid"), HARD_CAP,
                     id="another-pod-under-the-name-is-not-its"),
        pytest.param({POLICY_ANNOTATION: "{not json"}, owner(), HARD_CAP,
                     id="malformed-a-hard-cap"),
    ],
)  # fmt: skip
async def test_the_policy_is_its_pods_annotation_once_read(
    cluster: tuple[FakeApiServer, Any],
    annotations: dict[str, str] | None,
    who: Owner,
    expected: SharePolicy,
) -> None:
    fake, api = cluster
    fake.put(pod(annotations))
    spawner = Spawner(api)
    policies = PodPolicies(spawner)
    assert policies(who) == HARD_CAP  # asked, not waited for
    await spawner.settled()
    assert policies(who) == expected
    assert spawner.calls == 1 or expected == HARD_CAP


async def test_a_pod_not_found_is_a_hard_cap_and_read_once(
    cluster: tuple[FakeApiServer, Any],
) -> None:
    spawner = Spawner(cluster[1])
    policies = PodPolicies(spawner)
    policies(owner())
    await spawner.settled()
    assert (policies(owner()), policies(owner()), spawner.calls) == (HARD_CAP, HARD_CAP, 1)


async def test_an_unreadable_policy_is_asked_again_after_the_retry_time(
    cluster: tuple[FakeApiServer, Any],
) -> None:
    fake, api = cluster
    fake.put(pod({POLICY_ANNOTATION: "[1, 2]"}))
    now = [0.0]
    spawner = Spawner(api)
    policies = PodPolicies(spawner, retry_s=10, clock=lambda: now[0])
    policies(owner())
    await spawner.settled()
    assert policies(owner()) == HARD_CAP
    now[0] = 5
    policies(owner())
    assert spawner.calls == 1
    now[0] = 11
    policies(owner())
    assert spawner.calls == 2
