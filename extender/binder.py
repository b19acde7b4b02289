"""The bind verb: book the pod's cards in the node's ledger, then bind it with its record.

Write-then-bind (docs/design/extender-memo.md §2.4, §3):

1. Read the pod: it must exist with the UID the scheduler sent, and be unbound. A pod bound to
   this node by an earlier attempt whose answer was lost is a success (an idempotent retry).
2. Book: a compare-and-swap of the node's ``GPUNodeLedger`` adds ``booking(uid)``, placed by the
   same fit as filter, against the stored ledger (not the view filter read). A booking that is
   there already, from an attempt that died before its Binding, is reused unchanged: a booking
   is never rewritten, so a pod's record always equals its booking.
3. Bind: POST the Binding with ``metadata.uid`` (precondition) and the record as an annotation,
   merged into the pod in the same write that sets ``spec.nodeName``. On 409, read the pod: bound
   here with this record means another attempt of ours won, a success; anything else is an
   error, and the booking is left for reclaim (``extender.reclaim``).

Every failure is an ``Error`` in the reply: the scheduler forgets the assumed pod and retries
it. A replica that dies after step 2 leaves a booking held by an unbound pod, the safe side:
capacity reserved, nothing running; the pod's retry reuses it, or reclaim frees it once the pod
is deleted or bound elsewhere.

No clock and no lock appear here: two replicas, or an old leader that keeps writing, are made
safe by the ledger's compare-and-swap and the Binding's preconditions alone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from core.placement import PLACEMENT_ANNOTATION, PlacementError, parse, render
from extender.booking import Booker, NoRoom
from extender.demand import DemandError, PodDemand, pod_demand
from extender.ledger import Booking
from extender.ledgerstore import TooManyConflicts, Unavailable
from extender.pods import BindConflict, PodApi, PodApiDown, PodGone
from extender.view import NO_INVENTORY, NodeCards
from extender.wire import ExtenderBindingArgs, ExtenderBindingResult

log = logging.getLogger(__name__)


class BindError(Exception):
    """Why a pod was not bound, as the scheduler will report it on the pod."""


def _meta(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    meta = obj.get("metadata")
    return meta if isinstance(meta, Mapping) else {}


def _spec(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    spec = obj.get("spec")
    return spec if isinstance(spec, Mapping) else {}


def landed(pod: Mapping[str, Any] | None, uid: str, node: str, record: str | None) -> bool:
    """Whether ``pod`` is this incarnation bound to ``node`` with ``record`` (None: any record
    naming ``node``; an earlier attempt's Binding, whose record we do not hold)."""
    if pod is None or _meta(pod).get("uid") != uid or _spec(pod).get("nodeName") != node:
        return False
    annotations = _meta(pod).get("annotations")
    held = annotations.get(PLACEMENT_ANNOTATION) if isinstance(annotations, Mapping) else None
    if record is not None:
        return held == record
    try:
        found = parse(held, pod=str(_meta(pod).get("name")))
    except PlacementError:
        return False
    return found.node == node


@dataclass
class Binder:
    """Binds pods for the scheduler. ``cards``: a node's cards (the Node informer's view);
    ``models``: the GPU models the cluster knows, to read a pod's model choice."""

    pods: PodApi
    # How bookings reach the node's ledger: one write per pod (DirectBooker), or one write per
    # burst of a node's binds (GroupBooker, what the service runs).
    booker: Booker
    cards: Callable[[str], NodeCards | None]
    models: Callable[[], Iterable[str]] = tuple
    # Told how long each stage of a bind took: read, book, post (a metric).
    on_stage: Callable[[str, float], None] = lambda stage, seconds: None
    # A pod as the informer holds it (namespace, name), to spare a read per bind.
    cached: Callable[[str, str], Mapping[str, Any] | None] = lambda ns, name: None

    async def bind(self, args: ExtenderBindingArgs) -> ExtenderBindingResult:
        """The bind verb's answer: empty ``Error`` when the pod is bound with its record."""
        try:
            await self.bind_pod(args)
        except BindError as err:
            log.info(
                "bind refused",
                extra={"pod": f"{args.pod_namespace}/{args.pod_name}", "node": args.node},
            )
            return ExtenderBindingResult(error=str(err))
        return ExtenderBindingResult()

    async def bind_pod(self, args: ExtenderBindingArgs) -> None:
        """Book, then bind; BindError says why not."""
        ns, name, uid, node = args.pod_namespace, args.pod_name, args.pod_uid, args.node
        who = f"pod {ns}/{name}"
        start = time.perf_counter()
        pod = self._cached_unbound(ns, name, uid) or await self._read(ns, name, who)
        start = self._stage("read", start)
        if _meta(pod).get("uid") != uid:
            raise BindError(f"{who} was deleted and created again; this attempt was for UID {uid}")
        bound = _spec(pod).get("nodeName")
        if bound:
            if bound == node and landed(pod, uid, node, None):
                return  # an earlier attempt of ours bound it; its answer was lost
            raise BindError(f"{who} is bound to node {bound} already")
        if _meta(pod).get("deletionTimestamp"):
            raise BindError(f"{who} is being deleted")
        try:
            demand = pod_demand(pod, self.models())
        except DemandError as err:
            raise BindError(f"{who}: {err}") from None
        annotations: dict[str, str] = {}
        if demand.wants_gpu:
            booking = await self._book(node, demand)
            annotations[PLACEMENT_ANNOTATION] = render(booking.record(node))
            start = self._stage("book", start)
        await self._post(args, annotations, who)
        self._stage("post", start)

    def _stage(self, stage: str, since: float) -> float:
        now = time.perf_counter()
        self.on_stage(stage, now - since)
        return now

    def _cached_unbound(self, ns: str, name: str, uid: str) -> Mapping[str, Any] | None:
        """The pod from the informer's cache when it is this incarnation, unbound and not being
        deleted: its demand is what filter judged. Anything else is read from the API server,
        which decides it. A cache that trails the pod costs nothing in safety: the Binding's UID
        precondition, and the API server's refusal to bind a pod that is bound or being
        deleted, stand behind it (a booking made for such a pod is then reclaimed)."""
        pod = self.cached(ns, name)
        if pod is None or _meta(pod).get("uid") != uid:
            return None
        if _spec(pod).get("nodeName") or _meta(pod).get("deletionTimestamp"):
            return None
        return pod

    async def _read(self, ns: str, name: str, who: str) -> Mapping[str, Any]:
        try:
            pod = await self.pods.get(ns, name)
        except PodApiDown as err:
            raise BindError(f"{who} could not be read: {err}") from None
        if pod is None:
            raise BindError(f"{who} no longer exists")
        return pod

    async def _book(self, node: str, demand: PodDemand) -> Booking:
        """The pod's booking in the node's stored ledger: found, or added by CAS."""
        cards = self.cards(node)
        if cards is None:
            raise BindError(f"node {node}: {NO_INVENTORY}")
        try:
            return await self.booker.book(node, cards, demand)
        except NoRoom as err:
            raise BindError(f"node {node}: {err} any more; the pod will be retried") from None
        except (TooManyConflicts, Unavailable) as err:
            raise BindError(f"node {node}: the booking was not stored: {err}") from None

    async def _post(self, args: ExtenderBindingArgs, annotations: dict[str, str], who: str) -> None:
        ns, name, uid, node = args.pod_namespace, args.pod_name, args.pod_uid, args.node
        record = annotations.get(PLACEMENT_ANNOTATION)
        try:
            await self.pods.bind(ns, name, uid, node, annotations)
        except BindConflict as err:
            try:
                pod = await self.pods.get(ns, name)
            except PodApiDown:
                pod = None
            if record is not None and landed(pod, uid, node, record):
                return  # a concurrent attempt of ours bound it with the same booking
            raise BindError(f"{who} was not bound to node {node}: {err}") from None
        except PodGone:
            raise BindError(f"{who} no longer exists") from None
        except PodApiDown as err:
            raise BindError(f"{who} was not bound to node {node}: {err}") from None
