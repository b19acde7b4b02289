"""The extender as ``fracgpu serve`` runs it: its configuration, its caches, its three HTTP
endpoints and its reclaim loop.

filter and prioritize read two informers' caches (Nodes for the cards, ``GPUNodeLedger``s for the
bookings) and call nothing; bind writes the ledger and the Binding (``extender.binder``). Until
both caches have listed, filter answers with an ``Error`` (the scheduler requeues the pod) rather
than judge nodes against an empty view.

Reclaim runs on every replica: a pass only removes bookings on evidence that stays true, so two
replicas reclaiming at once is safe, and costs at most a conflict. A pass over every ledger runs
periodically; a pod event that may end a booking (the pod deleted, ended, or bound) triggers a
pass over the ledgers that book it at once. The event itself is never the evidence (an informer
that stops or relists reports objects as deleted that may not be): the pass asks the API
server. Forwarding binds to one leader
(as the quota service forwards its decisions) would only lower the conflict rate; it is not
needed for safety and is left out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Literal, TypeVar

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from core.informer import Informer, Informers
from core.kube import NODES, PODS, Api, RawBody
from extender.binder import Binder
from extender.booking import GroupBooker
from extender.ledger import Ledger, LedgerError, from_object
from extender.ledgerstore import (
    GPUNODELEDGERS,
    KubeLedgerStore,
    TooManyConflicts,
    Unavailable,
    newer,
)
from extender.metrics import ExtenderMetrics
from extender.pods import KubePods, PodApiDown
from extender.reclaim import TERMINAL, reclaim_node
from extender.verbs import View, filter_nodes, prioritize
from extender.view import NodeCards, node_cards
from extender.wire import (
    ExtenderArgs,
    ExtenderBindingArgs,
    ExtenderFilterResult,
    priorities_wire,
)

log = logging.getLogger(__name__)

FILTER_PATH = "/extender/filter"
PRIORITIZE_PATH = "/extender/prioritize"
BIND_PATH = "/extender/bind"
Handler = Callable[[web.Request], Awaitable[web.Response]]
T = TypeVar("T")


class ExtenderConfig(BaseModel):
    """The ``extender`` section of serve's configuration."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(
        default=False,
        description="serve the scheduler extender (device-plugin mode, cards placed at "
        "scheduling time); the scheduler's profile must name it in `extenders`",
    )
    policy: Literal["pack", "spread"] = Field(
        default="pack", description="prioritize: fill partly used cards first, or spread"
    )
    reclaim_interval_seconds: float = Field(
        default=30.0, gt=0, description="how often every ledger is checked for ended pods"
    )
    request_timeout_seconds: float = Field(default=5.0, gt=0, le=60)
    port: int = Field(
        default=8444,
        ge=1,
        le=65535,
        description="the extender's own HTTPS port (on server.host), which requires a client "
        "certificate signed by fracgpu's CA: bind binds pods with serve's permissions, and the "
        "admission port takes callers without one (the API server)",
    )
    client_secret_name: str = Field(
        default="fracgpu-scheduler-client-tls",
        min_length=1,
        description="the Secret (in certs.namespace) the scheduler mounts its client "
        "certificate from: serve issues it there and renews it in certs mode secret; in certs "
        "mode files the issuer of the mounted certificates (cert-manager) fills it",
    )
    scheduler_deployment: str = Field(
        default="fracgpu-scheduler",
        description="the scheduler's Deployment (in certs.namespace), which serve restarts "
        "when the CAs in the client certificate Secret change (certs mode secret), because "
        "kube-scheduler reads its caFile only at start; empty: never (restart it yourself "
        "within certs.ca_propagation of a CA rotation)",
    )


class ExtenderService:
    """The caches, the endpoints and the reclaim loop over one API client."""

    def __init__(
        self,
        api: Api,
        informers: Informers,
        config: ExtenderConfig,
        metrics: ExtenderMetrics | None = None,
    ) -> None:
        self.config = config
        self.metrics = metrics or ExtenderMetrics()
        self.nodes: Informer = informers.of(NODES)
        self.ledgers: Informer = informers.of(GPUNODELEDGERS)
        timeout = config.request_timeout_seconds
        self.store = KubeLedgerStore(
            api,
            owner=self._node_uid,
            request_timeout_s=timeout,
            on_write=self.metrics.ledger_written,
        )
        self.pods = KubePods(api, request_timeout_s=timeout)
        self.pod_events: Informer = informers.of(PODS)
        self.binder = Binder(
            self.pods,
            # Binds of one node in a burst share one ledger write (extender.booking).
            GroupBooker(self.store, on_write=self.metrics.batch.observe),
            self.cards,
            self.models,
            cached=lambda ns, name: self.pod_events.get(name, ns),
            on_stage=self.metrics.staged,
        )
        self.view = View(self.cards, self.ledger, self.models)
        self._cards: dict[str, tuple[str, NodeCards | None]] = {}
        self._ledgers: dict[str, tuple[str, Ledger]] = {}
        self._dirty: set[str] = set()
        self._reclaimed_once = False
        self._wake = asyncio.Event()

    # --- the view -------------------------------------------------------------------------

    def ready(self) -> bool:
        """Whether filter may answer: the caches have listed, and the first reclaim pass has
        released the bookings of pods that went while no extender ran (an upgrade, a restart).
        Until then filter answers an error, which the scheduler retries within seconds; a pod
        rejected for room a stale booking held would wait for an unrelated cluster event."""
        return self.nodes.has_synced and self.ledgers.has_synced and self._reclaimed_once

    def cards(self, node: str) -> NodeCards | None:
        """The node's cards, parsed once per version of its Node object."""
        obj = self.nodes.get(node)
        if obj is None:
            return None
        version = str((obj.get("metadata") or {}).get("resourceVersion") or "")
        cached = self._cards.get(node)
        if cached is None or cached[0] != version:
            cached = (version, node_cards(obj))
            self._cards[node] = cached
        return cached[1]

    def ledger(self, node: str) -> Ledger | None:
        """The node's ledger: the informer's, or this replica's own last read or write of it
        when that is newer (the watch has not brought it yet). Parsed once per version of the
        object, and the same ``Ledger`` object returned until it changes: filter keeps its
        verdicts while the objects are the same (``verbs.Verdicts``)."""
        obj = self.ledgers.get(node)
        stored = None
        if obj is not None:
            version = str((obj.get("metadata") or {}).get("resourceVersion") or "")
            kept = self._ledgers.get(node)
            if kept is not None and kept[0] == version:
                stored = kept[1]
            else:
                try:
                    stored = from_object(obj)
                except LedgerError as err:
                    log.warning("unreadable GPUNodeLedger", extra={"node": node, "error": str(err)})
                    return None
                self._ledgers[node] = (version, stored)
        own = self.store.recalled(node)
        if stored is None and own is None:
            return None
        return newer(stored, own)

    def models(self) -> Iterable[str]:
        return {p for n in self.nodes.objects() for p in (self._products(n))}

    def _products(self, node: Any) -> Iterable[str]:
        name = str((node.get("metadata") or {}).get("name") or "")
        cards = self.cards(name)
        return cards.products.values() if cards else ()

    def _node_uid(self, node: str) -> str | None:
        obj = self.nodes.get(node)
        return None if obj is None else (obj.get("metadata") or {}).get("uid")

    # --- endpoints ------------------------------------------------------------------------

    def routes(self) -> dict[str, Handler]:
        return {
            FILTER_PATH: self.filter,
            PRIORITIZE_PATH: self.prioritize,
            BIND_PATH: self.bind,
        }

    async def filter(self, request: web.Request) -> web.Response:
        async def decide(args: ExtenderArgs) -> tuple[Any, bool]:
            if not self.ready():
                result = ExtenderFilterResult(
                    error="fracgpu's extender has not listed the Nodes and GPUNodeLedgers yet"
                )
            else:
                result = filter_nodes(args, self.view)
            return result.wire(), bool(result.error)

        return await self._answer("filter", request, ExtenderArgs.model_validate_json, decide)

    async def prioritize(self, request: web.Request) -> web.Response:
        async def decide(args: ExtenderArgs) -> tuple[Any, bool]:
            return priorities_wire(prioritize(args, self.view, self.config.policy)), False

        return await self._answer("prioritize", request, ExtenderArgs.model_validate_json, decide)

    async def bind(self, request: web.Request) -> web.Response:
        async def decide(args: ExtenderBindingArgs) -> tuple[Any, bool]:
            result = await self.binder.bind(args)
            return result.wire(), bool(result.error)

        return await self._answer("bind", request, ExtenderBindingArgs.model_validate_json, decide)

    async def _answer(
        self,
        verb: str,
        request: web.Request,
        parse: Callable[[bytes], T],
        decide: Callable[[T], Awaitable[tuple[Any, bool]]],
    ) -> web.Response:
        """One verb's call, timed and counted: the scheduler's request parsed (400 when it is
        not its wire shape), then ``decide``'s reply and whether it is an error."""
        with self.metrics.timed(verb):
            try:
                args = parse(await request.read())
            except ValidationError as err:
                self.metrics.answered(verb, "bad-request")
                return _bad(err)
            reply, failed = await decide(args)
            self.metrics.answered(verb, "error" if failed else "ok")
            return web.json_response(reply)

    # --- lifecycle ------------------------------------------------------------------------

    async def run(self) -> None:
        """Keep the caches and reclaim ended pods' bookings until cancelled."""
        self.pod_events.add_handler(self.on_pod)
        try:
            async with self.nodes, self.ledgers, self.pod_events:
                # The first pass must see every ledger: before the informer has listed there
                # is nothing to reclaim, and stale bookings would wait a whole interval.
                await self.ledgers.wait_synced()
                while True:
                    await self.reclaim_all()
                    self._reclaimed_once = True
                    await self._reclaim_dirty_until(self.config.reclaim_interval_seconds)
        finally:
            self.pod_events.remove_handler(self.on_pod)

    def on_pod(self, kind: str, pod: RawBody) -> None:
        """Mark the nodes whose ledgers book a pod that may have let go of its booking."""
        meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
        phase = (pod.get("status") or {}).get("phase")
        bound = spec.get("nodeName")
        if kind != "DELETED" and phase not in TERMINAL and not bound:
            return
        uid = meta.get("uid")
        for obj in self.ledgers.objects():
            node = str((obj.get("metadata") or {}).get("name") or "")
            bookings = (obj.get("spec") or {}).get("bookings") or {}
            if uid not in bookings:
                continue
            if kind != "DELETED" and phase not in TERMINAL and bound == node:
                continue  # bound here and running: its booking stays
            self._dirty.add(node)
            self._wake.set()

    async def _reclaim_dirty_until(self, seconds: float) -> None:
        """Reclaim the nodes pod events mark, as they are marked, for ``seconds``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        while (left := deadline - loop.time()) > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), left)
            self._wake.clear()
            dirty, self._dirty = self._dirty, set()
            for node in sorted(dirty):
                await self._reclaim(node)

    async def reclaim_all(self) -> int:
        """One reclaim pass over every node's ledger; how many bookings it released."""
        released = 0
        for obj in self.ledgers.objects():
            released += await self._reclaim(str((obj.get("metadata") or {}).get("name") or ""))
        return released

    async def _reclaim(self, node: str) -> int:
        try:
            freed = await reclaim_node(self.store, self.pods, node)
        except (TooManyConflicts, Unavailable, PodApiDown) as err:
            log.warning("reclaim pass failed", extra={"node": node, "error": str(err)})
            return 0  # the next pass tries again: a delay costs utilisation only
        if freed:
            log.info("bookings released", extra={"node": node, "released": freed})
        return len(freed)


def _bad(err: ValidationError) -> web.Response:
    return web.json_response({"Error": f"bad extender request: {err}"}, status=400)
