"""Leader election with a coordination.k8s.io Lease: exactly one replica runs the controller.

The algorithm is client-go's: the holder renews ``spec.renewTime`` every renew interval; a
candidate takes the Lease over only when the record it observed has not changed for a whole
``leaseDurationSeconds`` of its *own* clock (so clock skew between nodes does not matter).
Every write carries the resourceVersion read, so two candidates cannot both win. A leader
that cannot renew within the lease duration stops its work before another may take over.

A leader that stops (a rolling update, a drained node) first stops its work, then **releases**
the Lease: it writes an empty holder, as client-go's ``ReleaseOnCancel`` does, so that the next
replica, restarted or already running, takes over at its next try instead of waiting out the
whole lease duration. After a crash nothing is released and the Lease expires by itself; until
then admissions are not held up (a quota nobody has counted is counted by the replica whose pod
needs it, :meth:`quota.usable.UsableQuotas.counted`), only the matching of admissions to pods.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from contextlib import suppress
from datetime import UTC, datetime
from typing import Any

import aiohttp
from prometheus_client import CollectorRegistry

from core.kube import LEASES, Api, KubeError, call_json
from quota.config import LeaderElection
from quota.forward import DECIDER_ANNOTATION
from quota.metrics import QuotaMetrics

log = logging.getLogger(__name__)


def _micro_time() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderElector:
    def __init__(
        self,
        api: Api,
        config: LeaderElection,
        *,
        metrics: QuotaMetrics | None = None,
        request_timeout_s: float = 2.0,
        advertise: str | None = None,
    ) -> None:
        """``advertise``: the URL at which this replica decides quota for the others while it
        leads (:mod:`quota.forward`), written on the Lease; None: it decides only its own."""
        self.api = api
        self.advertise = advertise
        # Where the current leader decides quota, as last read from the Lease (None: unknown,
        # expired, or this replica leads).
        self._leader_url: str | None = None
        self.config = config
        self.identity = config.holder()
        self.namespace = config.namespace()
        self.metrics = metrics or QuotaMetrics(CollectorRegistry())
        self.request_timeout_s = request_timeout_s
        self.is_leader = False
        self._observed: tuple[str, str] | None = None  # (holder, renewTime) last seen
        self._observed_at = 0.0
        # Why Lease requests fail, while they do: logged when it changes, not every renewal.
        self.problem: str | None = None

    async def run(self, work: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Run ``work`` while holding the Lease; stop it as soon as the Lease may be lost."""
        task: asyncio.Task[None] | None = None
        last_renewal = 0.0
        try:
            while True:
                ok = await self._try()
                clock = time.monotonic()
                if ok:
                    last_renewal = clock
                    if task is None or task.done():
                        log.info("quota controller leader", extra={"identity": self.identity})
                        task = asyncio.create_task(work(), name="quota-controller")
                elif task is not None and (
                    clock - last_renewal
                    >= self.config.lease_duration_s - self.config.renew_interval_s
                    or not self.is_leader
                ):
                    log.warning(
                        "quota controller lost the Lease", extra={"identity": self.identity}
                    )
                    await self._stop(task)
                    task = None
                self.metrics.leader.set(1 if task is not None else 0)
                await asyncio.sleep(self.config.renew_interval_s)
        finally:
            if task is not None:
                await self._stop(task)
            self.metrics.leader.set(0)
            if self.is_leader:
                await self._release()

    async def _release(self) -> None:
        """Give the Lease up (its work has stopped): an empty holder, which any candidate takes
        at once. Best effort within one request timeout; a failure leaves the Lease to expire."""
        path = LEASES.path(self.namespace, self.config.lease_name)
        self.is_leader = False
        try:
            lease = await call_json(self.api, "GET", path, timeout_s=self.request_timeout_s)
            spec = lease.get("spec") or {}
            if spec.get("holderIdentity") != self.identity:
                return  # taken over meanwhile: not ours to release
            body = self._lease(
                lease,
                transitions=int(spec.get("leaseTransitions") or 0),
                acquired=spec.get("acquireTime") or _micro_time(),
            )
            body["spec"]["holderIdentity"] = ""
            body["metadata"].pop("annotations", None)  # no decider: nobody leads
            await call_json(self.api, "PUT", path, body=body, timeout_s=self.request_timeout_s)
            log.info("quota controller Lease released", extra={"identity": self.identity})
        except Exception as err:
            # Best effort on the way out, whatever failed: the API server, the network, or a
            # client its owner closed before this ran (then the Lease expires as before).
            log.warning(
                "quota controller Lease not released; it expires by itself",
                extra={"identity": self.identity, "error": str(err) or type(err).__name__},
            )

    @staticmethod
    async def _stop(task: asyncio.Task[None]) -> None:
        task.cancel()
        with suppress(asyncio.CancelledError, Exception):
            await task

    async def _try(self) -> bool:
        """Acquire or renew; whether this replica holds the Lease now."""
        path = LEASES.path(self.namespace, self.config.lease_name)
        try:
            try:
                lease = await call_json(self.api, "GET", path, timeout_s=self.request_timeout_s)
            except KubeError as err:
                if err.status != 404:
                    raise
                body = self._lease(None, transitions=0, acquired=_micro_time())
                await call_json(
                    self.api,
                    "POST",
                    LEASES.path(self.namespace),
                    body=body,
                    timeout_s=self.request_timeout_s,
                )
                self._ok()
                self.is_leader = True
                self._leader_url = None
                self.metrics.controller_seen.set(1)
                return True
            spec = lease.get("spec") or {}
            holder = str(spec.get("holderIdentity") or "")
            record = (holder, str(spec.get("renewTime") or ""))
            if record != self._observed:
                self._observed, self._observed_at = record, time.monotonic()
            expired = time.monotonic() - self._observed_at > float(
                spec.get("leaseDurationSeconds") or self.config.lease_duration_s
            )
            self._ok()
            if holder and holder != self.identity and not expired:
                annotations = (lease.get("metadata") or {}).get("annotations") or {}
                url = annotations.get(DECIDER_ANNOTATION)
                self._leader_url = url if isinstance(url, str) and url else None
                self.is_leader = False
                self.metrics.controller_seen.set(1)
                return False
            transitions = int(spec.get("leaseTransitions") or 0)
            acquired = spec.get("acquireTime") or _micro_time()
            if holder != self.identity:
                transitions, acquired = transitions + 1, _micro_time()
            body = self._lease(lease, transitions=transitions, acquired=acquired)
            updated = await call_json(
                self.api, "PUT", path, body=body, timeout_s=self.request_timeout_s
            )
            spec = updated.get("spec") or {}
            self._observed = (self.identity, str(spec.get("renewTime") or ""))
            self._observed_at = time.monotonic()
            self.is_leader = True
            self._leader_url = None
            self.metrics.controller_seen.set(1)
            return True
        except KubeError as err:
            if err.status != 409:  # 409: someone else wrote first, which is no problem
                self._failed(str(err.status), str(err))
            return False
        except (TimeoutError, aiohttp.ClientError, OSError) as err:
            self._failed("network", str(err) or type(err).__name__)
            return False

    def leader_url(self) -> str | None:
        """Where to send quota decisions: the leader's advertised URL while another replica
        holds an unexpired Lease, else None (decide here)."""
        if self.is_leader or self._leader_url is None:
            return None
        held_for = time.monotonic() - self._observed_at
        return self._leader_url if held_for <= self.config.lease_duration_s else None

    def _failed(self, code: str, error: str) -> None:
        """A Lease request failed: count it, and log it when the cause is new (a missing
        namespace or RBAC fails the same way every renew interval)."""
        self.metrics.lease_errors.labels(code).inc()
        self.metrics.controller_seen.set(1 if self.is_leader else 0)
        problem = (
            f"the quota controller cannot use its Lease {self.namespace}/{self.config.lease_name}"
            f" ({error}); until it can, no replica counts pods, so GPU that ended pods held "
            f"stays charged and new GPUQuotas are not counted"
        )
        if code == "404":
            problem += (
                f"; does namespace {self.namespace!r} exist? (set POD_NAMESPACE or "
                f"quota.leader_election.lease_namespace)"
            )
        elif code == "403":
            problem += "; grant leases get/create/update in that namespace (deploy/base RBAC)"
        if problem != self.problem:
            log.error(problem, extra={"identity": self.identity, "code": code})
        self.problem = problem

    def _ok(self) -> None:
        if self.problem is not None:
            log.info(
                "quota controller Lease requests work again", extra={"identity": self.identity}
            )
        self.problem = None

    def _lease(
        self, current: dict[str, Any] | None, *, transitions: int, acquired: Any
    ) -> dict[str, Any]:
        metadata: dict[str, Any] = {"name": self.config.lease_name, "namespace": self.namespace}
        if current is not None:
            metadata["resourceVersion"] = current["metadata"]["resourceVersion"]
        if self.advertise:
            metadata["annotations"] = {DECIDER_ANNOTATION: self.advertise}
        return {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": metadata,
            "spec": {
                "holderIdentity": self.identity,
                "leaseDurationSeconds": max(1, round(self.config.lease_duration_s)),
                "acquireTime": acquired,
                "renewTime": _micro_time(),
                "leaseTransitions": transitions,
            },
        }
