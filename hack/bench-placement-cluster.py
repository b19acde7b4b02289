"""Pods placed per second in device-plugin mode, through the scheduler extender against the same
scheduler profile without it, on the project's own cluster, in one run.

    hack/cluster/up.sh && source /var/lib/fracgpu-cluster/e2e.env
    make image && ctr -n k8s.io images import .build/image/fracgpu.tar   # as make e2e does
    PYTHONPATH=. .venv/bin/python hack/bench-placement-cluster.py [--cards 8 --pods 48 --rounds 3]

The release is installed as the e2e suite installs it (``helm install`` of the chart with the
image, a node of ``--cards`` fake cards), once per placement in ``--order``: ``extender`` (the
chart's default in device-plugin mode: the fracgpu-scheduler profile calls serve's extender,
which books each pod's card and binds it) and ``node`` (the same profile with no extender; the
device plugin picks the card later, at kubelet's admission). Each round creates ``--pods``
shares held back by a scheduling gate, removes every gate at once, and times until the last
pod is bound (placed) and until the last one runs; then deletes them all and waits until
they are gone. Creating them first keeps admission out of the figure: what is timed is the
scheduler's work, with or without the extender's calls.

Prints one line per round and, last, the ratio of the medians (extender / node).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.kube import PODS, call_json
from tests.e2e.harness import ClusterPortal, Kubectl, Settings, kubectl_binary
from tests.e2e.release import installed, release_node_of, share_pod, user_namespace

Obj = dict[str, Any]
GATE = "fracgpu.io/bench"
CONCURRENCY = 16
WITHIN_S = 300.0


@dataclass(frozen=True)
class Round:
    placement: str
    pods: int
    bound_s: float
    running_s: float | None

    @property
    def placed_per_s(self) -> float:
        return self.pods / self.bound_s


def gated_pod(name: str) -> Obj:
    obj = share_pod(name, "0.1", "1Gi", scheduler="fracgpu-scheduler")
    obj["spec"]["schedulingGates"] = [{"name": GATE}]
    return obj


async def each(calls: list[Any]) -> None:
    """Run the coroutines, at most CONCURRENCY at a time."""
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(call: Any) -> None:
        async with gate:
            await call

    await asyncio.gather(*(one(c) for c in calls))


async def listed(api: Any, namespace: str) -> list[Obj]:
    items: list[Obj] = (await call_json(api, "GET", PODS.path(namespace)))["items"]
    return items


class BenchError(RuntimeError):
    """A round that could not be measured: pods failed, or did not get there in time."""


async def until(api: Any, namespace: str, done: Any, what: str) -> float:
    """Monotonic time at which ``done(pods)`` first held, polled every 50 ms. A pod that fails
    is an error, unless it is being deleted (a deleted pod ends Failed when its container is
    killed)."""
    deadline = time.monotonic() + WITHIN_S
    while True:
        pods = await listed(api, namespace)
        failed = [
            f"{p['metadata']['name']}: {p['status'].get('reason')}: {p['status'].get('message')}"
            for p in pods
            if p["status"].get("phase") == "Failed" and not p["metadata"].get("deletionTimestamp")
        ]
        if failed:
            raise BenchError(f"pods failed ({what}): {failed}")
        if done(pods):
            return time.monotonic()
        if time.monotonic() > deadline:
            raise BenchError(f"not {what} within {WITHIN_S:.0f} s")
        await asyncio.sleep(0.05)


async def one_round(api: Any, namespace: str, placement: str, count: int, serial: int) -> Round:
    names = [f"b{serial}-{i}" for i in range(count)]
    await each([call_json(api, "POST", PODS.path(namespace), body=gated_pod(n)) for n in names])
    ungate = [{"op": "remove", "path": "/spec/schedulingGates"}]
    start = time.monotonic()
    await each(
        [
            call_json(
                api,
                "PATCH",
                PODS.path(namespace, n),
                body=ungate,
                content_type="application/json-patch+json",
            )
            for n in names
        ]
    )
    bound = await until(
        api, namespace, lambda ps: all(p["spec"].get("nodeName") for p in ps), "bound"
    )
    try:
        running: float | None = await until(
            api,
            namespace,
            lambda ps: all(p["status"].get("phase") == "Running" for p in ps),
            "running",
        )
    except BenchError as err:  # reported beside the placement figure, which stands
        print(f"  {err}", flush=True)
        running = None
    await each([call_json(api, "DELETE", PODS.path(namespace, n)) for n in names])
    await until(api, namespace, lambda ps: not ps, "deleted")
    return Round(placement, count, bound - start, None if running is None else running - start)


PREFIXES = (
    "fracgpu_extender_duration_seconds_",
    "fracgpu_extender_bind_stage_seconds_",
    "fracgpu_extender_bookings_per_write_",
    "fracgpu_extender_ledger_write_seconds_",
)


def extender_figures(kubectl: Kubectl) -> str:
    """Each webhook replica's extender figures from its /metrics (through the API server's
    pod proxy): calls, mean time per verb, and pods booked per ledger write."""
    lines = []
    pods = kubectl.ok(
        "get", "pods", "-n", "fracgpu", "-l", "app.kubernetes.io/name=fracgpu-webhook",
        "-o", "jsonpath={.items[*].metadata.name}",
    ).split()  # fmt: skip
    for pod in pods:
        text = kubectl.ok(
            "get", "--raw", f"/api/v1/namespaces/fracgpu/pods/https:{pod}:8443/proxy/metrics"
        )
        values: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith(PREFIXES) and "_bucket" not in line:
                name, _, value = line.rpartition(" ")
                values[name] = float(value)
        parts = []
        for verb in ("filter", "prioritize", "bind"):
            count = values.get(f'fracgpu_extender_duration_seconds_count{{verb="{verb}"}}', 0.0)
            total = values.get(f'fracgpu_extender_duration_seconds_sum{{verb="{verb}"}}', 0.0)
            if count:
                parts.append(f"{verb} {count:.0f} calls, mean {1000 * total / count:.1f} ms")
        for stage in ("read", "book", "post"):
            count = values.get(f'fracgpu_extender_bind_stage_seconds_count{{stage="{stage}"}}', 0.0)
            total = values.get(f'fracgpu_extender_bind_stage_seconds_sum{{stage="{stage}"}}', 0.0)
            if count:
                parts.append(f"bind's {stage} mean {1000 * total / count:.1f} ms")
        for outcome in ("written", "conflict", "error"):
            key = f'fracgpu_extender_ledger_write_seconds_{{}}{{{{outcome="{outcome}"}}}}'
            count = values.get(key.format("count"), 0.0)
            if count:
                mean = 1000 * values.get(key.format("sum"), 0.0) / count
                parts.append(f"ledger {outcome} {count:.0f}, mean {mean:.1f} ms")
        writes = values.get("fracgpu_extender_bookings_per_write_count", 0.0)
        if writes:
            booked = values.get("fracgpu_extender_bookings_per_write_sum", 0.0)
            parts.append(f"{writes:.0f} ledger writes, {booked / writes:.1f} pods each")
        lines.append(f"  {pod}: " + ("; ".join(parts) or "no extender calls"))
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cards", type=int, default=8, help="fake cards on the node")
    parser.add_argument("--pods", type=int, default=48, help="0.1-card shares per round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per installed release")
    parser.add_argument(
        "--order", default="extender,node", help="placements, one release each, in this order"
    )
    parser.add_argument(
        "--webhook-replicas", type=int, default=0, help="fracgpu serve replicas (0: the chart's)"
    )
    args = parser.parse_args()
    settings = Settings.from_env(os.environ)
    node = None if settings is None else release_node_of(settings)
    if settings is None or node is None:
        sys.stderr.write(
            "needs the e2e settings of the project's cluster with the release image: "
            "source /var/lib/fracgpu-cluster/e2e.env (docs/testing.md)\n"
        )
        return 2
    kubectl = Kubectl(settings.kubeconfig, kubectl_binary())
    rounds: list[Round] = []
    serial = 0
    for placement in args.order.split(","):
        values: Obj = {"placement": placement}
        if args.webhook_replicas:
            values["webhook"] = {"replicas": args.webhook_replicas}
        with (
            tempfile.TemporaryDirectory() as workdir,
            installed(
                "device-plugin", node, settings, kubectl, Path(workdir),
                extra_values=values, cards=args.cards,
            ),
            user_namespace(kubectl) as namespace,
            ClusterPortal(settings.kubeconfig) as portal,
        ):  # fmt: skip
            for _ in range(args.rounds):
                serial += 1
                done = portal.run(
                    one_round(portal.api, namespace, placement, args.pods, serial),
                    timeout=4 * WITHIN_S,
                )
                rounds.append(done)
                ran = "not all" if done.running_s is None else f"{done.running_s:6.2f} s"
                print(
                    f"{placement:8} {done.pods} pods: bound in {done.bound_s:6.2f} s "
                    f"({done.placed_per_s:6.1f} placed/s), all running in {ran}",
                    flush=True,
                )
            if placement == "extender":
                print(extender_figures(kubectl), flush=True)
    rates = {
        p: statistics.median(r.placed_per_s for r in rounds if r.placement == p)
        for p in {r.placement for r in rounds}
    }
    print("median placed/s: " + ", ".join(f"{p} {v:.1f}" for p, v in sorted(rates.items())))
    if "extender" in rates and "node" in rates:
        ratio = rates["extender"] / rates["node"]
        print(f"extender / node (the same profile without the extender): {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
