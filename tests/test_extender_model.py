"""The extender's safety argument (memo §3), checked exhaustively on small clusters.

Two replicas' worth of concurrent bind attempts, replicas dying at any point (between the
ledger's compare-and-swap and the Binding included), pods deleted, created again under the same
name, ending, and reclaim passes: every interleaving of their API calls, up to a bound, run
through the real ``Binder`` and ``reclaim_node`` against an in-memory API server and ledger store.
Each API call is one atomic step, and the driver chooses which actor takes the next one. A
replica that dies is an actor never resumed: the interleavings in which an actor takes no
further step are exactly its deaths at that point (after its booking and before its Binding
among them), so death needs no action of its own. After every step:

- **I1** no stored ledger books a card beyond its capacity;
- **I2** every live, bound, not-ended pod carries a record, and its node's ledger holds its
  booking with exactly that record;
- no card holds more than its capacity in the records of the pods bound to it (no double booking);
- a bind that answered success left the pod bound there with its record.

No clock is involved: the actors are coroutines driven step by step (no event loop), and a state
is identified by the world's objects plus each live actor's history of answers, which is all a
deterministic actor's future depends on. States already seen are not explored again.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Awaitable, Callable, Coroutine, Generator, Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest

from core.placement import PLACEMENT_ANNOTATION, booked, overbooked, parse
from extender.binder import Binder
from extender.booking import DirectBooker
from extender.ledger import Ledger
from extender.ledgerstore import Conflict, MemoryLedgerStore, NotFound
from extender.pods import BindConflict, PodGone
from extender.reclaim import reclaim_node
from extender.view import NodeCards, node_cards
from extender.wire import ExtenderBindingArgs
from testkit.extender import Gpu, node, pod


class Step:
    """The point before an API call where the driver may switch actors (or never resume this
    one: a replica that dies there)."""

    def __await__(self) -> Generator[Step, None, None]:
        yield self


@dataclass
class World:
    """The API server's pods (as JSON: cheap to copy, never shared by mistake) and the ledger
    store, shared by every actor."""

    pods: dict[str, str]
    store: MemoryLedgerStore = field(default_factory=MemoryLedgerStore)
    incarnation: dict[str, int] = field(default_factory=dict)

    def copy(self) -> World:
        return World(dict(self.pods), self.store.copy(), dict(self.incarnation))

    def pod(self, name: str) -> dict[str, Any] | None:
        text = self.pods.get(name)
        return None if text is None else json.loads(text)

    def put(self, obj: dict[str, Any]) -> None:
        self.pods[obj["metadata"]["name"]] = json.dumps(obj, sort_keys=True)


Answer = tuple[bool, Any]  # (raised, the value or the exception)


class Calls:
    """One actor's API: every call is a step, and its answer is recorded, so that a copy of
    the actor can be brought to the same point by answering it from the record (``script``)
    without touching the world."""

    def __init__(self, world: World, script: list[Answer] | None = None) -> None:
        self.world = world
        self.script = list(script or [])
        self.answers: list[Answer] = []
        self.history: list[str] = []

    async def _answer(self, live: Callable[[], Awaitable[Any]]) -> Any:
        if self.script:
            raised, value = self.script.pop(0)
        else:
            await Step()
            try:
                raised, value = False, await live()
            except (PodGone, BindConflict, Conflict, NotFound) as err:
                raised, value = True, err
            self.history.append(json.dumps([raised, value], sort_keys=True, default=repr))
        self.answers.append((raised, value))
        if raised:
            raise type(value)(*value.args)
        return json.loads(value) if isinstance(value, str) and value[:1] == "{" else value

    # PodApi
    async def get(self, namespace: str, name: str) -> dict[str, Any] | None:
        async def live() -> str | None:
            return self.world.pods.get(name)  # its JSON: an answer no one can change

        answer: dict[str, Any] | None = await self._answer(live)
        return answer

    async def bind(
        self, namespace: str, name: str, uid: str, node_name: str, annotations: Mapping[str, str]
    ) -> None:
        async def live() -> str:
            target = self.world.pod(name)
            if target is None:
                raise PodGone(f"pods {name!r} not found")
            if target["metadata"]["uid"] != uid:
                raise BindConflict("Precondition failed: UID")
            if target["spec"].get("nodeName"):
                raise BindConflict(f"pod {name} is already assigned")
            target["spec"]["nodeName"] = node_name
            meta = target["metadata"]
            meta["annotations"] = {**(meta.get("annotations") or {}), **annotations}
            self.world.put(target)
            return "201"

        await self._answer(live)


class Ledgers:
    """The LedgerStore over an actor's Calls."""

    def __init__(self, calls: Calls) -> None:
        self.calls = calls
        self.store = calls.world.store

    async def get(self, node_name: str) -> Ledger | None:
        answer: Ledger | None = await self.calls._answer(
            lambda: self.calls.world.store.get(node_name)
        )
        return answer

    async def create(self, ledger: Ledger) -> Ledger:
        answer: Ledger = await self.calls._answer(lambda: self.calls.world.store.create(ledger))
        return answer

    async def replace(self, ledger: Ledger) -> Ledger:
        answer: Ledger = await self.calls._answer(lambda: self.calls.world.store.replace(ledger))
        return answer

    def recalled(self, node_name: str) -> Ledger | None:
        """Every write starts from a read here; a recalled ledger can only make a write
        conflict (tests/test_extender_ledger.py)."""
        return None


@dataclass
class Actor:
    """A running bind or reclaim: how to make it again (``make``), its API, its coroutine."""

    label: str
    make: Callable[[Calls], Coroutine[Any, Any, Any]]
    done: Callable[[Model, Any], None]
    calls: Calls
    coro: Coroutine[Any, Any, Any]


@dataclass(frozen=True)
class Scenario:
    nodes: tuple[dict[str, Any], ...]
    pods: tuple[tuple[str, int, int], ...]  # name, core, memory blocks
    binds: int  # bind attempts in all
    deletes: int = 1  # pod deletions (a deleted pod may be created again, as often)
    ends: int = 0  # pods reaching Succeeded
    reclaims: int = 1  # reclaim passes


class Model:
    """One state: the world, the live actors, the budgets left; the actions and the checks."""

    def __init__(self, scenario: Scenario) -> None:
        self.scenario = scenario
        self.cards: dict[str, NodeCards] = {}
        for obj in scenario.nodes:
            cards = node_cards(obj)
            assert cards is not None
            self.cards[cards.node] = cards
        self.shapes = {name: (core, memory) for name, core, memory in scenario.pods}
        self.world = World({})
        for name in self.shapes:
            self.world.put(pod(name, self.shapes[name], uid=f"{name}-0"))
        self.actors: list[Actor] = []
        self.budget = {
            "bind": scenario.binds,
            "delete": scenario.deletes,
            "create": scenario.deletes,
            "end": scenario.ends,
            "reclaim": scenario.reclaims,
        }

    def clone(self) -> Model:
        twin = copy.copy(self)
        twin.world = self.world.copy()
        twin.budget = dict(self.budget)
        twin.actors = []
        for actor in self.actors:
            calls = Calls(twin.world, actor.calls.answers)
            calls.history = list(actor.calls.history)
            coro = actor.make(calls)
            twin.actors.append(Actor(actor.label, actor.make, actor.done, calls, coro))
            assert isinstance(coro.send(None), Step)  # answered from the record up to its step
        return twin

    # --- actions --------------------------------------------------------------------------

    def actions(self) -> list[tuple[str, str]]:
        found = [("step", str(i)) for i in range(len(self.actors))]
        pods = {name: self.world.pod(name) or {} for name in self.world.pods}
        if self.budget["bind"]:
            found += [
                ("bind", f"{name}@{n}")
                for name, p in sorted(pods.items())
                if not p["spec"].get("nodeName")
                for n in sorted(self.cards)
            ]
        if self.budget["delete"]:
            found += [("delete", name) for name in sorted(pods)]
        if self.budget["create"]:
            found += [("create", name) for name in sorted(self.shapes) if name not in pods]
        if self.budget["end"]:
            found += [("end", n) for n, p in sorted(pods.items()) if p["spec"].get("nodeName")]
        if self.budget["reclaim"]:
            found += [("reclaim", n) for n in sorted(self.cards)]
        return found

    def apply(self, action: tuple[str, str]) -> None:
        kind, arg = action
        if kind == "step":
            self._resume(self.actors[int(arg)])
        elif kind == "crash":
            self.actors.pop(int(arg)).coro.close()
        elif kind == "bind":
            self.budget["bind"] -= 1
            self._bind(*arg.split("@"))
        elif kind == "delete":
            self.budget["delete"] -= 1
            del self.world.pods[arg]
        elif kind == "create":
            self.budget["create"] -= 1
            count = self.world.incarnation.get(arg, 0) + 1
            self.world.incarnation[arg] = count
            self.world.put(pod(arg, self.shapes[arg], uid=f"{arg}-{count}"))
        elif kind == "end":
            self.budget["end"] -= 1
            ended = self.world.pod(arg)
            assert ended is not None
            self.world.put({**ended, "status": {"phase": "Succeeded"}})
        elif kind == "reclaim":
            self.budget["reclaim"] -= 1

            def make(calls: Calls) -> Coroutine[Any, Any, Any]:
                return reclaim_node(Ledgers(calls), calls, arg)

            self._start(f"reclaim {arg}", make, lambda model, result: None)

    def _bind(self, name: str, node_name: str) -> None:
        uid = (self.world.pod(name) or {})["metadata"]["uid"]
        args = ExtenderBindingArgs(pod_name=name, pod_namespace="team", pod_uid=uid, node=node_name)
        cards = self.cards.get

        def make(calls: Calls) -> Coroutine[Any, Any, Any]:
            return Binder(calls, DirectBooker(Ledgers(calls)), cards).bind(args)

        def done(model: Model, result: Any) -> None:
            """A bind that answered success left this pod bound there with its record."""
            bound = model.world.pod(name)
            if result.error or bound is None or bound["metadata"]["uid"] != uid:
                return
            assert bound["spec"]["nodeName"] == node_name, result
            assert PLACEMENT_ANNOTATION in bound["metadata"]["annotations"]

        self._start(f"bind {uid}@{node_name}", make, done)

    def _start(
        self,
        label: str,
        make: Callable[[Calls], Coroutine[Any, Any, Any]],
        done: Callable[[Model, Any], None],
    ) -> None:
        calls = Calls(self.world)
        actor = Actor(label, make, done, calls, make(calls))
        self.actors.append(actor)
        self._resume(actor)

    def _resume(self, actor: Actor) -> None:
        try:
            actor.coro.send(None)
        except StopIteration as stop:
            self.actors.remove(actor)
            actor.done(self, stop.value)

    # --- state and checks -----------------------------------------------------------------

    def fingerprint(self) -> object:
        store = self.world.store
        ledgers = tuple(sorted((n, repr(sorted(lg.bookings.items())), lg.version)
                               for n, lg in store.objects.items()))  # fmt: skip
        pods = tuple(sorted(self.world.pods.items()))
        actors = tuple(sorted((a.label, tuple(a.calls.history)) for a in self.actors))
        budget = tuple(sorted(self.budget.items()))
        return (ledgers, store.written, pods, actors, budget, tuple(self.world.incarnation.items()))

    def check(self) -> None:
        ledgers = self.world.store.objects
        for name, ledger in ledgers.items():  # I1
            assert ledger.overbooked(self.cards[name].cards) == [], f"I1: {ledger}"
        placements: dict[str, list[Any]] = {n: [] for n in self.cards}
        for name in self.world.pods:
            p = self.world.pod(name) or {}
            bound = p["spec"].get("nodeName")
            if not bound or (p.get("status") or {}).get("phase") == "Succeeded":
                continue
            annotations = p["metadata"].get("annotations") or {}
            assert PLACEMENT_ANNOTATION in annotations, f"bound without a record: {p}"
            record = parse(annotations[PLACEMENT_ANNOTATION], pod=name)
            assert record.node == bound
            on_node = ledgers.get(bound)
            held = on_node.bookings.get(p["metadata"]["uid"]) if on_node else None
            assert held is not None, f"I2: {name} bound to {bound} without a booking"
            assert dict(held.containers) == dict(record.containers), "I2: record != booking"
            placements[bound] += list(record.containers.values())
        for n, placed in placements.items():  # no double booking among running pods
            assert overbooked(booked(self.cards[n].cards, placed)) == []


def explore(scenario: Scenario) -> int:
    """Every state reachable by the scenario's budgets; the number of distinct states."""
    root = Model(scenario)
    seen = {root.fingerprint()}
    stack = [root]
    while stack:
        model = stack.pop()
        for action in model.actions():
            child = model.clone()
            child.apply(action)
            child.check()
            key = child.fingerprint()
            if key not in seen:
                seen.add(key)
                stack.append(child)
    return len(seen)


ONE_CARD = node("n1", Gpu("GPU-1", memory_mib=2048))  # 100 core, 8 blocks
OTHER = node("n2", Gpu("GPU-2", memory_mib=2048))
TWO_CARDS = node("n1", Gpu("GPU-1", memory_mib=2048), Gpu("GPU-3", memory_mib=2048))

AB = (("a", 60, 2), ("b", 60, 2))  # two pods, room for one on a card
SLOW = pytest.mark.slow

SCENARIOS = [
    pytest.param(
        Scenario((ONE_CARD,), AB, binds=3, deletes=0, reclaims=0),
        id="two pods, room for one: three binds, concurrent and repeated",
    ),
    pytest.param(
        Scenario((ONE_CARD,), AB, binds=2, deletes=1, reclaims=1),
        id="two pods, room for one: a delete and a reclaim pass among the binds",
    ),
    pytest.param(
        Scenario((ONE_CARD, OTHER), AB, binds=3, deletes=0, reclaims=0),
        id="two nodes: a pod bound elsewhere while booked here",
    ),
    pytest.param(
        Scenario((TWO_CARDS,), (("a", 100, 0), ("b", 50, 4)), binds=2, deletes=1, reclaims=1),
        id="a whole card and a share on a two-card node",
    ),
    pytest.param(
        Scenario((ONE_CARD,), (("a", 60, 2),), binds=2, deletes=1, ends=1, reclaims=2),
        id="one pod: ends, or is deleted and created again, with two reclaim passes",
        marks=SLOW,
    ),
    pytest.param(
        Scenario((ONE_CARD,), AB, binds=3, deletes=1, reclaims=1),
        id="two pods, room for one: three binds, a delete, a reclaim pass",
        marks=SLOW,
    ),
    pytest.param(
        Scenario((ONE_CARD, OTHER), AB, binds=3, deletes=0, reclaims=1),
        id="two nodes: three binds and a reclaim pass",
        marks=SLOW,
    ),
]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_interleaving_keeps_the_invariants(scenario: Scenario) -> None:
    assert explore(scenario) > 10


def run_out(model: Model) -> None:
    while model.actors:
        model.apply(("step", "0"))


def test_a_booking_left_by_a_crash_is_reused_by_the_retry_and_freed_once_deleted() -> None:
    """The sequence the proof's I5 walks: book, die before the Binding, retry, delete, reclaim."""
    model = Model(Scenario((ONE_CARD,), (("a", 60, 2),), binds=2, deletes=1, reclaims=2))
    store = model.world.store
    model.apply(("bind", "a@n1"))
    while "n1" not in store.objects:
        model.apply(("step", "0"))
    model.apply(("crash", "0"))  # booked, not bound
    assert not (model.world.pod("a") or {})["spec"].get("nodeName")
    model.apply(("reclaim", "n1"))
    run_out(model)
    booked_first = store.objects["n1"].bookings["a-0"]  # R4: kept for the retry
    model.apply(("bind", "a@n1"))
    run_out(model)
    model.check()
    assert store.objects["n1"].bookings == {"a-0": booked_first}
    model.apply(("delete", "a"))
    model.apply(("reclaim", "n1"))
    run_out(model)
    assert store.objects["n1"].bookings == {}  # R1
