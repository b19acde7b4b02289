"""Pods read live by the usage controller (quota.livepods) against the fake API server."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from quota.livepods import LivePods
from quota.store import Unavailable
from testkit.apiserver import DEFAULT_NAMESPACES, FakeApiServer
from testkit.quota_pods import gpu_pod


@pytest.fixture
async def fake() -> AsyncIterator[FakeApiServer]:
    async with FakeApiServer(namespaces=(*DEFAULT_NAMESPACES, "team-a", "team-b")) as server:
        yield server


@pytest.fixture
async def live(fake: FakeApiServer) -> AsyncIterator[LivePods]:
    async with fake.api_client() as api:
        yield LivePods(api, request_timeout_s=2.0, page_size=2)


@pytest.mark.parametrize(
    ("count", "requests"),
    [
        pytest.param(0, 1, id="empty-namespace-one-request"),
        pytest.param(2, 1, id="one-full-page"),
        pytest.param(5, 3, id="three-pages"),
    ],
)
async def test_read_lists_every_pod_of_the_namespace_page_by_page(
    fake: FakeApiServer, live: LivePods, count: int, requests: int
) -> None:
    for index in range(count):
        fake.put(gpu_pod(f"p{index}"))
    fake.put(gpu_pod("elsewhere", namespace="team-b"))
    before = len(fake.requests)
    pods = await live.read("team-a")
    assert sorted(p["metadata"]["name"] for p in pods) == [f"p{i}" for i in range(count)]
    assert len(fake.requests) - before == requests


@pytest.mark.parametrize(
    ("stored", "asked", "exists"),
    [
        pytest.param(True, ("p", "u1"), True, id="same-name-and-uid"),
        pytest.param(True, ("p", "other"), False, id="same-name-another-pod"),
        pytest.param(False, ("p", "u1"), False, id="no-such-pod"),
        pytest.param(True, ("", "u1"), False, id="admission-without-a-name"),
        pytest.param(True, ("p-<generated>", "u1"), False, id="generated-name-never-looked-up"),
    ],
)
async def test_exists_is_true_only_for_the_pod_of_that_name_and_uid(
    fake: FakeApiServer, live: LivePods, stored: bool, asked: tuple[str, str], exists: bool
) -> None:
    if stored:
        fake.put(gpu_pod("p", uid="u1"))
    before = len(fake.requests)
    assert await live.exists("team-a", *asked) is exists
    assert len(fake.requests) - before == (1 if asked[0] == "p" else 0)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        pytest.param(("read", "team-a"), "pods of team-a:", id="read"),
        pytest.param(("exists", "team-a", "p", "u1"), "pod team-a/p:", id="exists"),
    ],
)
@pytest.mark.parametrize("mode", ["503", "drop"])
async def test_an_api_server_out_of_reach_is_unavailable(
    fake: FakeApiServer, live: LivePods, call: tuple[Any, ...], message: str, mode: str
) -> None:
    fake.down(mode)
    method, *args = call
    with pytest.raises(Unavailable, match=message):
        await getattr(live, method)(*args)
