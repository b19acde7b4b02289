"""filter and prioritize: pure functions of the request and the extender's view.

Neither calls the API server: kube-scheduler's cycle is serial and waits on each, so they read
the informers' caches (Nodes, ``GPUNodeLedger``s) through :class:`View`. A view that lags only
lets a bind fail later (the binder re-checks against the stored ledger and the pod is
retried); it never places a pod on a card twice.

filter answers per node: fits; Failed (it would fit if pods ended: the scheduler may preempt);
or FailedAndUnresolvable (it would not fit the node empty: wrong models, too few or too small
cards, no inventory; preemption must not try it). Messages name no node, so the scheduler's
"0/N nodes are available: 3 <reason>" counts identical reasons together.

prioritize scores the nodes that fit, 0..10, from how full the cards the pod would get are
afterwards: *pack* prefers fuller cards (whole cards stay free for whole-card pods), *spread*
emptier ones. A node that already holds this pod's booking scores 10: a retried pod goes back
to the card reserved for it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

from core.units import CORE_PER_CARD
from extender.demand import DemandError, PodDemand, pod_demand
from extender.ledger import Ledger
from extender.view import NodeCards, Verdict, judge, node_cards
from extender.wire import (
    MAX_EXTENDER_PRIORITY,
    ExtenderArgs,
    ExtenderFilterResult,
    HostPriority,
    NodeList,
)

Policy = Literal["pack", "spread"]
POLICIES: tuple[Policy, ...] = ("pack", "spread")


class Verdicts:
    """Each node's verdict for a pod *shape*, kept while that node's cards and ledger are the
    very objects it was computed from.

    A Deployment's or a Job's pods share a shape, and between two of its pods most nodes did not
    change, so filter at 1,000 nodes mostly looks verdicts up instead of placing the pod on
    every node again. The key holds the objects themselves (compared by identity): the view
    replaces a node's cards or ledger with a new object whenever either changes, so a kept
    verdict is never stale. A pod with a booking of its own on the node is judged afresh (its
    booking is left out, which no other pod of its shape shares).
    """

    def __init__(self, limit: int = 65536) -> None:
        self.limit = limit
        self._kept: dict[tuple[str, tuple[object, ...]], tuple[object, object, Verdict]] = {}
        self.hits = 0

    def judge(
        self, name: str, cards: NodeCards | None, ledger: Ledger | None, demand: PodDemand
    ) -> Verdict:
        if cards is None or (ledger is not None and demand.uid in ledger.bookings):
            return judge(cards, ledger, demand)
        key = (name, demand.shape())
        kept = self._kept.get(key)
        if kept is not None and kept[0] is cards and kept[1] is ledger:
            self.hits += 1
            return kept[2]
        verdict = judge(cards, ledger, demand)
        if len(self._kept) >= self.limit:
            self._kept.clear()  # shapes come and go; a full recount is cheaper than LRU upkeep
        self._kept[key] = (cards, ledger, verdict)
        return verdict


@dataclass(frozen=True)
class View:
    """What the verbs read: each node's cards and ledger by name, and the models known.

    ``cards`` and ``ledger`` must return the same object for a node until it changes (the
    verdicts kept in ``verdicts`` rely on it)."""

    cards: Callable[[str], NodeCards | None]
    ledger: Callable[[str], Ledger | None]
    models: Callable[[], Iterable[str]]
    verdicts: Verdicts = field(default_factory=Verdicts)


def _candidates(args: ExtenderArgs, view: View) -> dict[str, NodeCards | None]:
    """The candidate nodes' cards: from the Nodes the scheduler sent if it sent them (not
    ``nodeCacheCapable``), else from the view."""
    if args.nodes is not None and args.node_names is None:
        return {
            str((n.get("metadata") or {}).get("name") or ""): node_cards(n)
            for n in args.nodes.items
        }
    return {name: view.cards(name) for name in args.names()}


def verdicts(args: ExtenderArgs, view: View) -> tuple[PodDemand | None, dict[str, Verdict]]:
    """Each candidate node's verdict for the pod (no demand: it asks for no fracgpu GPU)."""
    candidates = _candidates(args, view)
    demand = pod_demand(args.pod, view.models())
    if not demand.wants_gpu:
        return None, {}
    judge_ = view.verdicts.judge
    judged = {
        name: judge_(name, cards, view.ledger(name), demand) for name, cards in candidates.items()
    }
    return demand, judged


def filter_nodes(args: ExtenderArgs, view: View) -> ExtenderFilterResult:
    """The filter verb."""
    names = args.names()
    try:
        demand, judged = verdicts(args, view)
    except DemandError as err:
        return _filtered(args, [], {}, {name: str(err) for name in names})
    if demand is None:
        return _filtered(args, names, {}, {})
    passing = [name for name in names if judged[name].fits]
    failed = {n: v.reason for n, v in judged.items() if not v.fits and not v.unresolvable}
    never = {n: v.reason for n, v in judged.items() if not v.fits and v.unresolvable}
    return _filtered(args, passing, failed, never)


def _filtered(
    args: ExtenderArgs, passing: list[str], failed: dict[str, str], never: dict[str, str]
) -> ExtenderFilterResult:
    """The reply in the form the request came: names, or the Node objects themselves."""
    nodes = None
    if args.nodes is not None and args.node_names is None:
        keep = set(passing)
        items = [n for n in args.nodes.items if (n.get("metadata") or {}).get("name") in keep]
        nodes = NodeList(items=items)
    return ExtenderFilterResult(
        nodes=nodes, node_names=passing, failed_nodes=failed, failed_and_unresolvable=never
    )


def prioritize(args: ExtenderArgs, view: View, policy: Policy = "pack") -> list[HostPriority]:
    """The prioritize verb: a score for every candidate node (0 where the pod does not fit)."""
    try:
        demand, judged = verdicts(args, view)
    except DemandError:
        demand, judged = None, {}
    scores = []
    for name in args.names():
        verdict = judged.get(name)
        score = 0
        if demand is not None and verdict is not None and verdict.fits:
            ledger = view.ledger(name)
            own = ledger is not None and demand.uid in ledger.bookings
            score = MAX_EXTENDER_PRIORITY if own else _score(verdict, policy)
        scores.append(HostPriority(host=name, score=score))
    return scores


def _score(verdict: Verdict, policy: Policy) -> int:
    """0..10 from how full the pod's cards are once it is placed."""
    placed = verdict.placed.containers or {}
    used = {uuid for p in placed.values() for uuid in p.cards}
    cards = [c for c in verdict.placed.after if c.uuid in used]
    if not cards:
        return 0
    fill = sum(
        (c.core_used / CORE_PER_CARD + (c.memory_used / c.blocks if c.blocks else 1.0)) / 2
        for c in cards
    ) / len(cards)
    fill = min(max(fill, 0.0), 1.0)
    value = fill if policy == "pack" else 1.0 - fill
    return int(value * MAX_EXTENDER_PRIORITY + 0.5)  # half up, not to even
