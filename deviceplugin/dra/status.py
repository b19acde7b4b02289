"""Each prepared share, shown in its claim: ``ResourceClaim.status.devices``.

A user who asked for 0.3 of a card sees, with ``kubectl get resourceclaim -o yaml``, which card
the share landed on (UUID, model, index), the cores and MiB it holds, a ``Ready`` condition once
the node wrote its limits and CDI spec, and ``CardHealthy`` as the node's health monitor sees the
card. Entries are keyed by driver, pool, device and shareID (the API's list-map keys); this
module writes only the entries of this driver and keeps every other driver's.

Writes are not on kubelet's path: prepare and unprepare answer first and mark the claim; one
worker brings each marked claim's entries to what they should be. It reads the claim, replaces
this driver's entries, and patches ``status`` under the read's resourceVersion, so a concurrent
writer (another driver, the scheduler) makes it read again rather than lose an update. Nothing
is written when the entries already say the same (times aside), so a health change costs one
read per prepared claim and a write only where something changed.

Where the cluster does not keep ``status.devices`` (the DRAResourceClaimDeviceStatus feature
off: the API server drops the field) the first write shows it, the worker says so once and
stops. The plugin's RBAC needs ``patch`` on ``resourceclaims/status`` and, since Kubernetes
1.36, ``associated-node:patch`` on the synthetic ``resourceclaims/driver`` subresource named
after the driver (a plugin may change only its own driver's entries, for claims on its node).
"""

from __future__ import annotations

import asyncio
import datetime
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from core.kube import KubeConflict, KubeError, KubeNotFound
from deviceplugin.dra.claims import ClaimRef, Result

log = logging.getLogger(__name__)

Obj = dict[str, Any]
MIB = 1 << 20
READY = "Ready"
HEALTHY = "CardHealthy"
CONFLICT_RETRIES = 5
RETRY_S = 2.0  # after a failed write (API server down): the claim is tried again

# (method, path, body) -> the JSON answer; raises KubeError.
Call = Callable[[str, str, Obj | None], Awaitable[Obj]]
# A card index -> (healthy, reason).
HealthOf = Callable[[int], tuple[bool, str]]


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _condition(kind: str, ok: bool, reason: str, message: str) -> Obj:
    return {
        "type": kind,
        "status": "True" if ok else "False",
        "reason": reason,
        "message": message[:1024],
        "lastTransitionTime": _now(),
    }


def entries(driver: str, node: str, results: Iterable[Result], health_of: HealthOf) -> list[Obj]:
    """This driver's status.devices entries for a prepared claim's results."""
    out: list[Obj] = []
    for r in results:
        healthy, why = health_of(r.card.index)
        entry: Obj = {
            "driver": driver,
            "pool": r.pool,
            "device": r.device,
            "conditions": [
                _condition(READY, True, "Prepared", f"limits and CDI spec written on node {node}"),
                _condition(
                    HEALTHY,
                    healthy,
                    "Healthy" if healthy else "Unhealthy",
                    "the node's health monitor reads the card" if healthy else why,
                ),
            ],
            "data": {
                "card": r.card.index,
                "uuid": r.card.uuid,
                "model": r.card.product,
                "cores": r.cores,
                "memoryMiB": r.memory_bytes // MIB,
            },
        }
        if r.share_id is not None:
            entry["shareID"] = r.share_id
        out.append(entry)
    return out


def _key(entry: Obj) -> tuple[Any, ...]:
    return (entry.get("driver"), entry.get("pool"), entry.get("device"), entry.get("shareID"))


def _by_key(entries: list[Obj]) -> dict[tuple[Any, ...], Obj]:
    """Entries by their list-map key, condition times left out: what a write would change."""
    out: dict[tuple[Any, ...], Obj] = {}
    for entry in entries:
        conditions = [
            {k: v for k, v in c.items() if k != "lastTransitionTime"}
            for c in entry.get("conditions") or []
        ]
        out[_key(entry)] = {**entry, "conditions": conditions}
    return out


def _keep_transition_times(old: list[Obj], new: list[Obj]) -> None:
    """A condition whose status did not change keeps the time it last changed."""
    before = {_key(e): {c["type"]: c for c in e.get("conditions") or []} for e in old}
    for entry in new:
        seen = before.get(_key(entry), {})
        for condition in entry["conditions"]:
            prior = seen.get(condition["type"])
            if prior is not None and prior.get("status") == condition["status"]:
                condition["lastTransitionTime"] = prior.get(
                    "lastTransitionTime", condition["lastTransitionTime"]
                )


@dataclass
class ClaimStatusWriter:
    """Brings marked claims' status.devices entries of ``driver`` to what they should be."""

    call: Call
    claims_path: Callable[[ClaimRef], str]
    driver: str
    node: str
    health_of: HealthOf
    supported: bool | None = None  # None until the first write shows whether the field is kept
    writes: int = 0
    failures: int = 0
    on_write: Callable[[str], None] = lambda result: None  # "written" or "failed"
    _wanted: dict[str, tuple[ClaimRef, tuple[Result, ...]]] = field(default_factory=dict)
    _wake: asyncio.Event = field(default_factory=asyncio.Event)

    def mark(self, ref: ClaimRef, results: Iterable[Result]) -> None:
        """The claim's entries should be those of ``results`` (none: removed)."""
        if self.supported is False:
            return
        self._wanted[ref.uid] = (ref, tuple(results))
        self._wake.set()

    def idle(self) -> bool:
        return not self._wanted

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            batch, self._wanted = self._wanted, {}
            retry: dict[str, tuple[ClaimRef, tuple[Result, ...]]] = {}
            for uid, (ref, results) in batch.items():
                try:
                    await self.sync(ref, results)
                except (KubeError, aiohttp.ClientError, OSError, TimeoutError) as exc:
                    self.failures += 1
                    self.on_write("failed")
                    log.warning(
                        "claim status not written; retried",
                        extra={"claim": str(ref), "error": str(exc)},
                    )
                    retry[uid] = (ref, results)
                except Exception:  # a bug here must not stop the worker for every later claim
                    self.failures += 1
                    self.on_write("failed")
                    log.exception("claim status not written", extra={"claim": str(ref)})
            if retry:
                await asyncio.sleep(RETRY_S)
                for uid, wanted in retry.items():
                    self._wanted.setdefault(uid, wanted)  # a newer mark wins
                self._wake.set()

    async def sync(self, ref: ClaimRef, results: tuple[Result, ...]) -> None:
        """One claim: read it, replace this driver's entries, patch under its resourceVersion."""
        if self.supported is False:
            return
        path = self.claims_path(ref)
        for _ in range(CONFLICT_RETRIES):
            try:
                claim = await self.call("GET", path, None)
            except KubeNotFound:
                return  # deleted: nothing to show
            meta = claim.get("metadata") or {}
            if meta.get("uid") != ref.uid:
                return  # replaced under the same name
            status = claim.get("status") or {}
            if results and not status.get("allocation"):
                return  # deallocated since: its devices are no longer its own
            devices: list[Obj] = list(status.get("devices") or [])
            others = [d for d in devices if d.get("driver") != self.driver]
            old = [d for d in devices if d.get("driver") == self.driver]
            new = entries(self.driver, self.node, results, self.health_of)
            _keep_transition_times(old, new)
            if _by_key(old) == _by_key(new):
                return
            body = {
                "metadata": {"resourceVersion": meta.get("resourceVersion")},
                "status": {"devices": others + new},
            }
            try:
                written = await self.call("PATCH", f"{path}/status", body)
            except KubeConflict:
                continue  # someone wrote in between: read again
            self.writes += 1
            self.on_write("written")
            if new and self.supported is None:
                kept = (written.get("status") or {}).get("devices") or []
                self.supported = any(d.get("driver") == self.driver for d in kept)
                if not self.supported:
                    self._wanted.clear()
                    log.warning(
                        "this cluster does not keep ResourceClaim.status.devices (feature "
                        "DRAResourceClaimDeviceStatus off): shares are not shown in their claims"
                    )
            return
        raise KubeError(409, "Conflict", f"{ref}: status changed under every one of our writes")
