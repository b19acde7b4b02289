"""The placement record and the per-card fit policy, as tables.

The record is read by the extender, the device plugin and the webhook alike, so every way a value
can be wrong has a row here and its message names the pod and the value.
"""

from __future__ import annotations

import json

import pytest

from core.placement import (
    PLACEMENT_ANNOTATION,
    CardRoom,
    ContainerPlacement,
    PlacementError,
    PlacementRecord,
    booked,
    fit,
    numa_pick,
    overbooked,
    parse,
    read,
    render,
)

B = 96  # memory blocks of a 24 GiB card
POD = "team/train-0"


def rec(node: str = "n1", **containers: ContainerPlacement) -> PlacementRecord:
    return PlacementRecord(node, containers)


def share(*cards: str, core: int = 50, blocks: int = 32) -> ContainerPlacement:
    return ContainerPlacement(cards, core, blocks)


RENDERED = [
    pytest.param(
        rec(main=share("GPU-a")),
        '{"v":1,"node":"n1","containers":{"main":{"cards":["GPU-a"],"core":50,"memoryBlocks":32}}}',
        id="one share",
    ),
    pytest.param(
        rec(b=ContainerPlacement(("GPU-b", "GPU-c"), 200, 0)),
        '{"v":1,"node":"n1","containers":{"b":{"cards":["GPU-b","GPU-c"],"core":200,'
        '"memoryBlocks":0}}}',
        id="two whole cards",
    ),
    pytest.param(
        rec(z=share("GPU-a", core=10, blocks=1), a=share("GPU-a", core=20, blocks=2)),
        '{"v":1,"node":"n1","containers":{"a":{"cards":["GPU-a"],"core":20,"memoryBlocks":2},'
        '"z":{"cards":["GPU-a"],"core":10,"memoryBlocks":1}}}',
        id="containers sorted by name",
    ),
]


@pytest.mark.parametrize(("record", "text"), RENDERED)
def test_render_and_parse_round_trip(record: PlacementRecord, text: str) -> None:
    assert render(record) == text
    assert parse(text, pod=POD) == record
    assert hash(parse(text, pod=POD)) == hash(record)


def doc(**over: object) -> str:
    base: dict[str, object] = {
        "v": 1,
        "node": "n1",
        "containers": {"main": {"cards": ["GPU-a"], "core": 50, "memoryBlocks": 32}},
    }
    base.update(over)
    return json.dumps(base)


def ctr(**body: object) -> str:
    return doc(containers={"main": body})


BAD = [
    pytest.param(7, "must be a JSON string", id="not a string"),
    pytest.param("{", "is not JSON", id="not json"),
    pytest.param("[1]", "is not a JSON object", id="a list"),
    pytest.param(doc(v=2), "has version 2", id="newer version"),
    pytest.param(doc(v=True), "has version True", id="bool version"),
    pytest.param(doc(node=""), "names no node", id="empty node"),
    pytest.param(doc(node=3), "names no node", id="node not a string"),
    pytest.param(doc(containers={}), "names no container", id="no container"),
    pytest.param(doc(containers={"m": 1}), "container 'm' is not an object", id="body not object"),
    pytest.param(ctr(cards="GPU-a", core=50), "is not an object with cards", id="cards a string"),
    pytest.param(ctr(cards=["GPU-a"], core="50"), "is not an object with", id="core a string"),
    pytest.param(ctr(cards=["GPU-a"], core=True), "is not an object with", id="core a bool"),
    pytest.param(ctr(cards=[], core=50), "names no card", id="no card"),
    pytest.param(ctr(cards=[""], core=50), "not a non-empty UUID", id="empty uuid"),
    pytest.param(ctr(cards=["a", "a"], core=200), "names a card twice", id="card twice"),
    pytest.param(ctr(cards=["a"], core=0), "has core 0", id="no core"),
    pytest.param(ctr(cards=["a"], core=5, memoryBlocks=-1), "memoryBlocks -1", id="neg memory"),
    pytest.param(ctr(cards=["a"], core=150), "a share of a card is 1-99", id="1.5 cards"),
    pytest.param(ctr(cards=["a", "b"], core=50), "a share of one card names 2", id="share on two"),
    pytest.param(ctr(cards=["a"], core=200), "holds 2 whole card(s) but names 1", id="too few"),
    pytest.param("x" * 70000, "longer than", id="too long"),
]


@pytest.mark.parametrize(("raw", "why"), BAD)
def test_parse_refuses_with_pod_and_value(raw: object, why: str) -> None:
    with pytest.raises(PlacementError) as caught:
        parse(raw, pod=POD)
    message = str(caught.value)
    assert f"pod {POD}" in message
    assert PLACEMENT_ANNOTATION in message
    assert why in message
    if isinstance(raw, str) and len(raw) < 200:
        assert raw in message


def test_parse_ignores_unknown_keys_and_defaults_memory() -> None:
    text = json.dumps(
        {"v": 1, "node": "n", "extra": 1, "containers": {"c": {"cards": ["u"], "core": 100}}}
    )
    assert parse(text, pod=POD) == PlacementRecord("n", {"c": ContainerPlacement(("u",), 100, 0)})


READ = [
    pytest.param(None, None, id="no annotations"),
    pytest.param({}, None, id="no record"),
    pytest.param({PLACEMENT_ANNOTATION: doc()}, rec(main=share("GPU-a")), id="a record"),
]


@pytest.mark.parametrize(("annotations", "expected"), READ)
def test_read(annotations: object, expected: PlacementRecord | None) -> None:
    assert read(annotations, pod=POD) == expected


def test_read_raises_on_a_bad_record() -> None:
    with pytest.raises(PlacementError):
        read({PLACEMENT_ANNOTATION: "nope"}, pod=POD)


def card(index: int, core: int = 0, memory: int = 0, **kw: object) -> CardRoom:
    return CardRoom(index, f"GPU-{index}", B, core, memory, **kw)  # type: ignore[arg-type]


# (cards, core, memory blocks, indices of the chosen cards)
FIT = [
    pytest.param([card(0), card(1)], 0, 0, [], id="no core: nothing"),
    pytest.param([card(0), card(1)], 50, 10, [0], id="empty node: lower index"),
    pytest.param([card(0), card(1, 30, 10)], 50, 10, [1], id="partly used before free"),
    pytest.param([card(0, 40, 10), card(1, 30, 10)], 50, 10, [0], id="best fit: least core left"),
    pytest.param([card(0, 40, 10), card(1, 40, 20)], 50, 10, [1], id="ties: least memory left"),
    pytest.param([card(0, 60, 10), card(1)], 50, 10, [1], id="core does not fit: other card"),
    pytest.param([card(0, 10, 90), card(1)], 50, 10, [1], id="memory does not fit: other card"),
    pytest.param([card(0, 60, 10), card(1, 10, 90)], 50, 10, [], id="no one card has both"),
    pytest.param([card(0, healthy=False), card(1, 90)], 50, 1, [], id="unhealthy card: none"),
    pytest.param([card(0), card(1)], 150, 0, [], id="a share above one card"),
    pytest.param([card(0), card(1, 1)], 100, 0, [0], id="one whole card: entirely free"),
    pytest.param([card(0), card(1, 1)], 200, 0, [], id="two whole cards: one is used"),
    pytest.param([card(0, healthy=False), card(1)], 200, 0, [], id="two whole: one unhealthy"),
    pytest.param(
        [card(0, numa_node=0), card(1, numa_node=1), card(2, numa_node=1)],
        200,
        0,
        [1, 2],
        id="two whole cards on one NUMA node",
    ),
]


@pytest.mark.parametrize(("cards", "core", "memory", "expected"), FIT)
def test_fit(cards: list[CardRoom], core: int, memory: int, expected: list[int]) -> None:
    assert [c.index for c in fit(cards, core, memory)] == expected


NUMA = [
    pytest.param([0, 1, 2, 3], 2, {0: 0, 1: 1, 2: 1, 3: 0}, [0, 3], id="smallest fitting node"),
    pytest.param([0, 1, 2], 3, {0: 0, 1: 1, 2: 1}, [1, 2, 0], id="spans the fewest nodes"),
    pytest.param([0, 1], 1, {}, [0], id="unknown NUMA: lower index"),
]


@pytest.mark.parametrize(("whole", "need", "numa", "expected"), NUMA)
def test_numa_pick(whole: list[int], need: int, numa: dict[int, int], expected: list[int]) -> None:
    assert numa_pick(whole, need, numa) == expected


BOOKED = [
    pytest.param([], [(0, 0), (0, 0)], id="nothing booked"),
    pytest.param([share("GPU-0", core=30, blocks=5)], [(30, 5), (0, 0)], id="a share"),
    pytest.param(
        [share("GPU-0", core=30, blocks=5), share("GPU-0", core=20, blocks=1)],
        [(50, 6), (0, 0)],
        id="two shares add up",
    ),
    pytest.param([ContainerPlacement(("GPU-1",), 100, 0)], [(0, 0), (100, B)], id="whole card"),
    pytest.param([share("GPU-9")], [(0, 0), (0, 0)], id="card gone from the node: skipped"),
]


@pytest.mark.parametrize(("placements", "used"), BOOKED)
def test_booked(placements: list[ContainerPlacement], used: list[tuple[int, int]]) -> None:
    after = booked([card(0), card(1)], placements)
    assert [(c.core_used, c.memory_used) for c in after] == used


def test_overbooked() -> None:
    cards = booked([card(0, 60), card(1)], [share("GPU-0", core=50, blocks=1)])
    assert [c.index for c in overbooked(cards)] == [0]
    assert overbooked([card(0, 100, B)]) == []
