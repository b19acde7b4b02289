"""Quota decisions without a cluster, for ``fracgpu review --quota FILE``.

The pods are decided in order against the GPUQuotas of the file with the same engine as the
webhook (embedded mode): each admitted pod stays charged, so the tenth pod of a manifest
sees the nine before it, as it would in a namespace that starts empty (plus whatever the
file's ``status.used`` says is already used).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quota.demand import CardMemory, pod_demand
from quota.reserver import Reserver
from quota.store import MemoryStore, load_quota_file


@dataclass(frozen=True, slots=True)
class QuotaDecision:
    allowed: bool
    message: str = ""  # why it was denied; empty when allowed
    reason: str = ""  # fits, no-gpu, no-quota, exceeded, invalid-quota


async def review_pods_async(
    quota_file: Path | str,
    pods: Sequence[Mapping[str, Any]],
    *,
    require_quota: bool = False,
    card_memory: CardMemory | None = None,
) -> list[QuotaDecision]:
    """One decision per pod (canonical, i.e. already mutated), in order."""
    store = MemoryStore(load_quota_file(quota_file))
    reserver = Reserver(store, require_quota=require_quota, controller=False)
    decisions = []
    try:
        for index, pod in enumerate(pods):
            demand = pod_demand(pod, card_memory)
            if demand is None:
                decisions.append(QuotaDecision(True, reason="no-gpu"))
                continue
            meta = pod.get("metadata") if isinstance(pod.get("metadata"), Mapping) else {}
            assert isinstance(meta, Mapping)
            namespace = str(meta.get("namespace") or "default")
            name = str(meta.get("name") or f"{meta.get('generateName') or 'pod-'}<generated>")
            uid = str(meta.get("uid") or f"offline-{index}")
            decision = await reserver.decide(namespace, uid, name, demand)
            decisions.append(QuotaDecision(decision.allowed, decision.message, decision.reason))
    finally:
        await reserver.close()
    return decisions


def review_pods(
    quota_file: Path | str,
    pods: Sequence[Mapping[str, Any]],
    *,
    require_quota: bool = False,
    card_memory: CardMemory | None = None,
) -> list[QuotaDecision]:
    """:func:`review_pods_async` for synchronous callers (the CLI); not from a running loop."""
    return asyncio.run(
        review_pods_async(quota_file, pods, require_quota=require_quota, card_memory=card_memory)
    )
