"""``core.kube.call_answered``: 404 and 409 reach the caller as themselves, every other failure
as KubeUnavailable, whose message says what happened."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from core import kube
from core.kube import KubeConflict, KubeError, KubeNotFound, KubeUnavailable, call_answered


@pytest.mark.parametrize(
    ("raised", "expected", "message"),
    [
        pytest.param(KubeNotFound(404, "NotFound", "gone"), KubeNotFound, "gone", id="not-found"),
        pytest.param(
            KubeConflict(409, "Conflict", "changed"), KubeConflict, "changed", id="conflict"
        ),
        pytest.param(
            KubeError(500, "InternalError", "etcd"), KubeUnavailable,
            "the API server answered 500 InternalError: etcd", id="other-status",
        ),
        pytest.param(
            TimeoutError(), KubeUnavailable, "did not answer within 2s", id="timeout"
        ),
        pytest.param(
            aiohttp.ClientConnectionError("refused"), KubeUnavailable,
            r"could not be reached \(refused\)", id="no-connection",
        ),
    ],
)  # fmt: skip
async def test_failures_are_sorted(
    monkeypatch: pytest.MonkeyPatch, raised: Exception, expected: type[Exception], message: str
) -> None:
    async def failing(*args: Any, **kwargs: Any) -> dict[str, Any]:
        raise raised

    monkeypatch.setattr(kube, "call_json", failing)
    with pytest.raises(expected, match=message):
        await call_answered(object(), "GET", "/x", timeout_s=2)  # type: ignore[arg-type]


async def test_an_answer_is_returned(monkeypatch: pytest.MonkeyPatch) -> None:
    async def answering(*args: Any, **kwargs: Any) -> dict[str, Any]:
        return {"kind": "Pod"}

    monkeypatch.setattr(kube, "call_json", answering)
    assert await call_answered(object(), "GET", "/x") == {"kind": "Pod"}  # type: ignore[arg-type]
