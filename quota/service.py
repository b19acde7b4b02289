"""The one entry point ``fracgpu serve`` uses: :func:`open_quota` → :class:`QuotaService`.

* ``service.reviewer`` is the ``/validate`` reviewer, and ``service.decide_endpoint`` the
  handler of :data:`quota.forward.DECIDE_PATH`, where the leader decides for other replicas;
* ``await service.run()`` runs the usage controller under leader election (Kubernetes mode)
  until cancelled, and returns at once in embedded mode (nothing to reconcile: there are no
  pods to watch, every admitted pod stays charged);
* ``service.problem()`` is None when quota works, else what an operator must fix (the
  GPUQuota CRD is not installed). It is not a readiness condition: mutation needs no quota,
  so the server stays ready and GPU pods are denied with a message that names the fix.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry

from core.informer import Informers
from core.kube import Api
from quota.claims import ClaimSpecs, MostCards, Planned
from quota.config import QuotaConfig
from quota.controller import UsageController
from quota.demand import CardMemory
from quota.forward import Forwarder, decide_endpoint
from quota.kubestore import KubeQuotaStore
from quota.leader import LeaderElector
from quota.messages import crd_missing_problem
from quota.metrics import QuotaMetrics
from quota.reserver import Reserver
from quota.reviewer import QuotaReviewer
from quota.store import MemoryStore, NotFound, QuotaStore, Unavailable, load_quota_file

log = logging.getLogger(__name__)


class QuotaService:
    def __init__(
        self,
        config: QuotaConfig,
        store: QuotaStore,
        metrics: QuotaMetrics,
        api: Api | None = None,
        *,
        card_memory: CardMemory | None = None,
        planned_templates: Planned | None = None,
        most_cards: MostCards | None = None,
        peer_ca: Callable[[], bytes] | None = None,
        peer_name: str | None = None,
        informers: Informers | None = None,
    ) -> None:
        self.config = config
        self.informers = informers
        self.card_memory = card_memory
        self.store = store
        self.metrics = metrics
        self.api = api
        embedded = config.mode == "embedded"
        self.reserver = Reserver(
            store,
            metrics=metrics,
            timeout_s=config.timeout_s,
            max_attempts=config.max_attempts,
            require_quota=config.require_quota,
            pending_limit=config.pending_limit,
            controller=not embedded,
            stale_after_s=config.stale_after_s,
            count_wait_s=config.count_wait_s,
            counter=self._count if api is not None and not embedded else None,
        )
        # DRA mode: what pods' claims of the fracgpu class request (read, then remembered).
        self.claims = ClaimSpecs(
            api,
            request_timeout_s=config.request_timeout_s,
            planned=planned_templates,
            most_cards=most_cards,
        )
        election = config.leader_election
        self.elector = (
            LeaderElector(
                api,
                election,
                metrics=metrics,
                request_timeout_s=config.request_timeout_s,
                advertise=config.advertise_url,
            )
            if api is not None and election.enabled and not embedded
            else None
        )
        self.forwarder = (
            Forwarder(
                self.elector.leader_url,
                metrics,
                # The leader decides within timeout_s; waiting half of it leaves this replica
                # the other half to decide itself should the leader not answer.
                timeout_s=config.timeout_s / 2,
                ca_pem=peer_ca,
                server_name=peer_name,
            )
            if self.elector is not None and config.forward_to_leader
            else None
        )
        self.reviewer = QuotaReviewer(
            self.reserver, metrics, card_memory, self.claims, forwarder=self.forwarder
        )
        self.decide_endpoint = decide_endpoint(self.reserver, metrics)
        self._problem: str | None = None
        self._counter: UsageController | None = None
        self.probe_interval_s = 5.0

    def problem(self) -> str | None:
        return self._problem

    async def probe(self) -> None:
        """Check that GPUQuotas can be listed: a 404 means the CRD is not installed. Logged
        once when it goes missing and once when it is back, not at every probe."""
        try:
            await self.store.list(None)
        except NotFound:
            if self._problem is None:
                log.error(crd_missing_problem(), extra={"crd": "gpuquotas.fracgpu.io"})
            self._problem = crd_missing_problem()
            self.metrics.crd_installed.set(0)
            return
        except Unavailable as exc:
            log.warning("GPUQuota probe failed", extra={"error": str(exc)})
            return
        if self._problem is not None:
            log.info("GPUQuota CRD installed: GPU quota is checked again")
        self._problem = None
        self.metrics.crd_installed.set(1)

    async def _count(self, raw: Mapping[str, Any]) -> None:
        """Count a quota nobody has counted (:meth:`quota.usable.UsableQuotas.counted`): with a
        controller of its own whose watches never start, so the count reads pods live."""
        if self._counter is None:
            self._counter = self.controller(shared=False)
        await self._counter.count(raw)

    def controller(self, *, shared: bool = True) -> UsageController:
        """The usage controller; ``shared``: on the process's shared informers (the one that
        reconciles), else on watches of its own that never start (a count that reads live)."""
        assert self.api is not None
        return UsageController(
            self.api,
            # The controller reads quotas live: its own store, without the webhook's cache.
            KubeQuotaStore(self.api, request_timeout_s=self.config.request_timeout_s),
            metrics=self.metrics,
            resync_s=self.config.resync_s,
            max_attempts=self.config.max_attempts,
            request_timeout_s=self.config.request_timeout_s,
            grace_s=self.config.reservation_grace_s,
            pending_limit=self.config.pending_limit,
            card_memory=self.card_memory,
            claims=self.claims,
            informers=self.informers if shared else None,
        )

    async def run(self, leading: Sequence[Callable[[], Coroutine[Any, Any, None]]] = ()) -> None:
        """Count usage until cancelled: on the replica that holds the Lease (every replica
        without leader election). ``leading``: more jobs that must run on one replica only,
        there, beside the controller (waiting pods' Events, which every replica would
        otherwise post once each). Embedded (no cluster to count, no Lease): only those."""
        if self.api is None:
            await asyncio.gather(*(job() for job in leading))
            return
        while self._problem is not None:  # wait for the CRD before watching or reconciling
            await asyncio.sleep(self.probe_interval_s)
            await self.probe()
        if isinstance(self.store, KubeQuotaStore):
            self.store.start()

        async def reconcile() -> None:
            async with asyncio.TaskGroup() as group:
                group.create_task(self.controller().run())
                for job in leading:
                    group.create_task(job())

        if self.elector is None:
            await reconcile()
            return
        await self.elector.run(reconcile)

    async def close(self) -> None:
        if self.forwarder is not None:
            await self.forwarder.close()
        await self.reserver.close()
        if isinstance(self.store, KubeQuotaStore):
            await self.store.stop()


async def open_quota(
    config: QuotaConfig,
    api: Api | None,
    *,
    registry: CollectorRegistry | None = None,
    card_memory: CardMemory | None = None,
    planned_templates: Planned | None = None,
    most_cards: MostCards | None = None,
    peer_ca: Callable[[], bytes] | None = None,
    peer_name: str | None = None,
    informers: Informers | None = None,
) -> QuotaService:
    """Build the quota service. ``api`` is a kubernetes-asyncio ApiClient (Kubernetes mode,
    required) or None (embedded mode). ``registry``: where metrics go (the server's own).
    ``card_memory``: how much memory whole cards hold (the composition root knows the cards);
    ``most_cards``: the most fracgpu cards one node has (DRA mode's ``allocationMode: All``).
    ``peer_ca``, ``peer_name``: the CA and the name that the leader's serving certificate is
    checked against when decisions are forwarded to it (:mod:`quota.forward`)."""
    metrics = QuotaMetrics(registry or CollectorRegistry())
    if config.mode == "embedded":
        objects = load_quota_file(config.file) if config.file is not None else []
        return QuotaService(
            config,
            MemoryStore(objects),
            metrics,
            card_memory=card_memory,
            planned_templates=planned_templates,
            most_cards=most_cards,
        )
    if api is None:
        raise ValueError(
            "quota.mode is kubernetes but no Kubernetes client was given; configure cluster "
            "access, or set quota.mode: embedded with quota.file"
        )
    store = KubeQuotaStore(
        api, request_timeout_s=config.request_timeout_s, watch=True, informers=informers
    )
    service = QuotaService(
        config,
        store,
        metrics,
        api,
        card_memory=card_memory,
        planned_templates=planned_templates,
        most_cards=most_cards,
        peer_ca=peer_ca,
        peer_name=peer_name,
        informers=informers,
    )
    await service.probe()
    if service.problem() is None:
        store.start()  # else in run(), once the CRD is there: no watch retrying a 404
    return service
