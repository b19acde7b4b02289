"""``fracgpu quota``: the GPUQuotas of a namespace (or all) with used/limit and their pods.

Reads the cluster (kubeconfig, in-cluster, $KUBECONFIG) or, with ``--file``, a quota file as
embedded mode uses it. "used" is what the quota charges now: pods counted by the controller
plus admitted pods it has not seen yet ("PENDING" of them are listed one by one).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from core.kube import PODS, call_json, kube_client
from core.units import cards_text
from quota.claims import ClaimSpecs, claim_refs
from quota.demand import Demand, is_terminal, pod_demand
from quota.kubestore import KubeQuotaStore
from quota.ledger import Ledger
from quota.model import GPUQuota, QuotaError
from quota.store import MemoryStore, Unavailable, load_quota_file


def run(args: argparse.Namespace) -> int:
    try:
        quotas, pods, claims = asyncio.run(_load(args))
        output = getattr(args, "output", "text")
        if output == "json":
            print(json.dumps(document(quotas, pods, claims), indent=2))
        elif output == "yaml":
            print(yaml.safe_dump(document(quotas, pods, claims), sort_keys=False), end="")
        else:
            print(render(quotas, pods, show_pods=not args.no_pods, claims=claims), end="")
    except (QuotaError, Unavailable, OSError) as exc:
        print(f"fracgpu quota: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # kubeconfig and API errors from the client library
        print(f"fracgpu quota: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


async def _load(
    args: argparse.Namespace,
) -> tuple[list[GPUQuota], dict[str, list[dict[str, Any]]], ClaimSpecs | None]:
    """The quotas, their namespaces' pods and (DRA mode) the claims those pods name: a pod in
    DRA mode carries its share in its claims, not in its containers' resources."""
    namespace = None if args.all_namespaces else args.namespace
    if args.file:
        store = MemoryStore(load_quota_file(args.file))
        raws = await store.list(None if args.all_namespaces else (namespace or "default"))
        return [GPUQuota(raw) for raw in raws], {}, None
    async with kube_client(args.kubeconfig, args.context) as api:
        if namespace is None and not args.all_namespaces:
            namespace = "default"
        raws = await KubeQuotaStore(api, request_timeout_s=30).list(namespace)
        quotas = [GPUQuota(raw) for raw in raws]
        pods: dict[str, list[dict[str, Any]]] = {}
        for ns in sorted({q.namespace for q in quotas}):
            listed = await call_json(api, "GET", PODS.path(ns))
            pods[ns] = [p for p in listed.get("items") or [] if isinstance(p, dict)]
        claims = ClaimSpecs(api, request_timeout_s=30)
        await claims.load(ref for listed in pods.values() for p in listed for ref in claim_refs(p))
        return quotas, pods, claims


def render(
    quotas: Sequence[GPUQuota],
    pods: Mapping[str, Sequence[Mapping[str, Any]]],
    *,
    show_pods: bool = True,
    claims: ClaimSpecs | None = None,
) -> str:
    """The table, then per quota the pods charged to it (cluster) or reserved in it (file)."""
    if not quotas:
        return "No GPUQuotas found.\n"
    header = (
        "NAMESPACE",
        "NAME",
        "CARDS USED/LIMIT",
        "MEMORY MiB USED/LIMIT",
        "GPU PODS",
        "PENDING",
    )
    rows = [header]
    for quota in quotas:
        ledger = Ledger.of(quota)
        charged = ledger.charged(None)
        spec = quota.spec
        rows.append(
            (
                quota.namespace,
                quota.name,
                f"{cards_text(charged.core)}/{_limit(spec.gpu, cards_text)}",
                f"{charged.memory_mib}/{_limit(spec.gpumem, str)}",
                f"{charged.pods}/{_limit(spec.pods, str)}",
                str(len(ledger.pending)),
            )
        )
        for model, limit in sorted(spec.models.items()):
            used = ledger.charged(model)
            rows.append(
                (
                    "",
                    f"  model {model}",
                    f"{cards_text(used.core)}/{_limit(limit.gpu, cards_text)}",
                    f"{used.memory_mib}/{_limit(limit.gpumem, str)}",
                    f"{used.pods}/{_limit(limit.pods, str)}",
                    "",
                )
            )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [
        "   ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]
    if show_pods:
        for quota in quotas:
            lines.extend(_pod_lines(quota, pods.get(quota.namespace), claims))
    return "\n".join(lines) + "\n"


def _usage(core: int, memory_mib: int, pods: int) -> dict[str, Any]:
    return {"cards": cards_text(core), "memoryMiB": memory_mib, "pods": pods}


def _limits(gpu: int | None, gpumem: int | None, pods: int | None) -> dict[str, Any]:
    return {
        "cards": None if gpu is None else cards_text(gpu),
        "memoryMiB": gpumem,
        "pods": pods,
    }


def document(
    quotas: Sequence[GPUQuota],
    pods: Mapping[str, Sequence[Mapping[str, Any]]],
    claims: ClaimSpecs | None = None,
) -> list[dict[str, Any]]:
    """What ``render`` shows, as objects (``-o json|yaml``): per quota its use and limits, per
    GPU model too, and who uses it (``pending``: admitted, not yet seen as a pod)."""
    out = []
    for quota in quotas:
        ledger = Ledger.of(quota)
        used, spec = ledger.charged(None), quota.spec
        users = []
        counted = set()
        for pod in pods.get(quota.namespace) or []:
            demand = pod_demand(pod, claims=claims)
            if demand is None or is_terminal(pod):
                continue
            meta = pod.get("metadata") or {}
            counted.add(str(meta.get("uid")))
            users.append({"pod": meta.get("name"), **_usage(demand.core, demand.memory_mib, 1)})
        for entry in ledger.pending:
            if entry.uid not in counted:
                demand = entry.demand
                users.append(
                    {"pod": entry.pod, **_usage(demand.core, demand.memory_mib, 1), "pending": True}
                )
        out.append(
            {
                "namespace": quota.namespace,
                "name": quota.name,
                "used": _usage(used.core, used.memory_mib, used.pods),
                "limit": _limits(spec.gpu, spec.gpumem, spec.pods),
                "models": {
                    model: {
                        "used": _usage(u.core, u.memory_mib, u.pods),
                        "limit": _limits(limit.gpu, limit.gpumem, limit.pods),
                    }
                    for model, limit in sorted(spec.models.items())
                    for u in [ledger.charged(model)]
                },
                "pendingAdmissions": len(ledger.pending),
                "pods": users,
            }
        )
    return out


def _limit(value: int | None, fmt: Any) -> str:
    return "-" if value is None else str(fmt(value))


def _describe(demand: Demand) -> str:
    text = f"{cards_text(demand.core)} card, {demand.memory_mib} MiB"
    if demand.models is not None:
        text += f", on {', '.join(sorted(demand.models))}"
    return text


def _pod_lines(
    quota: GPUQuota, pods: Sequence[Mapping[str, Any]] | None, claims: ClaimSpecs | None
) -> list[str]:
    ledger = Ledger.of(quota)
    lines = [f"\n{quota.namespace}/{quota.name}:"]
    counted = set()
    for pod in pods or []:
        demand = pod_demand(pod, claims=claims)
        if demand is None or is_terminal(pod):
            continue
        meta = pod.get("metadata") or {}
        counted.add(str(meta.get("uid")))
        lines.append(f"  {meta.get('name')}  {_describe(demand)}")
    for entry in ledger.pending:
        if entry.uid in counted:
            continue
        lines.append(f"  {entry.pod}  {_describe(entry.demand)}  (pending)")
    if not ledger.unmatched.empty:
        more = ledger.unmatched.total
        lines.append(
            f"  and {more.pods} more admitted pods not yet seen by the controller  "
            f"{cards_text(more.core)} card, {more.memory_mib} MiB"
        )
    if len(lines) == 1:
        lines.append("  no GPU pods")
    return lines
