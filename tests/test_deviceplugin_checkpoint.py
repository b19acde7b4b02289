from __future__ import annotations

import json
from pathlib import Path

import pytest

from deviceplugin.classic import checkpoint
from deviceplugin.classic.allocation import Allocation
from deviceplugin.shared.inventory import Card

CARDS = {0: Card(0, "GPU-a", "Fake", 4096, 0, None), 1: Card(1, "GPU-b", "Fake", 4096, 1, 0)}


def test_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "state" / "checkpoint.json"
    allocations = [Allocation(("g0-c1",), ("g0-m0",), (0,), 12.5)]
    checkpoint.write(path, CARDS.values(), allocations)
    assert checkpoint.read(path, CARDS) == allocations
    assert [p.name for p in path.parent.iterdir()] == ["checkpoint.json"]  # no temp left


def test_missing_checkpoint_is_empty(tmp_path: Path) -> None:
    assert checkpoint.read(tmp_path / "none.json", CARDS) == []


def test_checkpoint_for_other_cards_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.json"
    checkpoint.write(path, CARDS.values(), [])
    swapped = {0: Card(0, "GPU-new", "Fake", 4096, 0, None), 1: CARDS[1]}
    with pytest.raises(checkpoint.CheckpointError, match="written for cards"):
        checkpoint.read(path, swapped)


@pytest.mark.parametrize("content", ["{", "[]", '{"version": 9}', '{"version":1,"cards":{}}'])
def test_corrupt_checkpoint_is_refused(tmp_path: Path, content: str) -> None:
    path = tmp_path / "checkpoint.json"
    path.write_text(content)
    with pytest.raises(checkpoint.CheckpointError):
        checkpoint.read(path, CARDS)


def test_failed_write_keeps_the_old_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.json"
    checkpoint.write(path, CARDS.values(), [])
    before = path.read_text()

    class Boom(Allocation):
        def to_json(self) -> dict[str, object]:
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        checkpoint.write(path, CARDS.values(), [Boom((), (), (), 0.0)])
    assert path.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.json"]


GOOD = {"key": "k1", "core": ["g0-c1"], "memory": ["g0-m0"], "cards": [0], "created": 1.0}


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param({**GOOD, "core": ["bogus"]}, id="an ID that is no fracgpu ID"),
        pytest.param({**GOOD, "core": "g0-c1"}, id="core as a string"),
        pytest.param({**GOOD, "core": [1]}, id="an ID that is no string"),
        pytest.param({**GOOD, "memory": ["g0-c2"]}, id="a core ID as memory"),
        pytest.param({**GOOD, "core": ["g7-c1"]}, id="a card this node lacks"),
        pytest.param({**GOOD, "memory": ["g0-m999"]}, id="a block the card lacks"),
        pytest.param({**GOOD, "core": [], "memory": []}, id="no IDs"),
        pytest.param({"core": ["g0-c1"]}, id="fields missing"),
        pytest.param("g0-c1", id="not an object"),
    ],
)
def test_a_bad_record_is_dropped_and_the_rest_restored(
    tmp_path: Path, bad: object, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "checkpoint.json"
    good = {**GOOD, "key": "k2", "core": ["g1-c3"], "memory": ["g1-m1"], "cards": [1]}
    document = {"version": 1, "cards": {"0": "GPU-a", "1": "GPU-b"}, "allocations": [bad, good]}
    path.write_text(json.dumps(document))
    restored = checkpoint.read(path, CARDS)
    assert [a.key for a in restored] == ["k2"]
    assert [r.getMessage() for r in caplog.records] == ["checkpoint record dropped"]


# A version 1 checkpoint exactly as the plugin wrote it while IDs named cards (two shares, one
# whole card without memory): its cards are where those containers run.
VERSION_1 = (
    '{"version":1,"cards":{"0":"GPU-a","1":"GPU-b"},"allocations":['
    '{"key":"5f0c","core":["g0-c0","g0-c1"],"memory":["g0-m0"],"cards":[0],"created":1764000000.5,'
    '"verified":true},'
    '{"key":"9a1e","core":["g1-c0","g1-c1","g1-c2"],"memory":["g1-m3","g1-m4"],"cards":[1],'
    '"created":1764000001.0,"verified":false}]}'
)


def test_a_version_1_checkpoint_is_read_with_its_cards(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.json"
    path.write_text(VERSION_1)
    restored = checkpoint.read(path, CARDS)
    assert [(a.key, a.cards, len(a.core), len(a.memory)) for a in restored] == [
        ("5f0c", (0,), 2, 1),
        ("9a1e", (1,), 3, 2),
    ]
    checkpoint.write(path, CARDS.values(), restored)
    assert json.loads(path.read_text())["version"] == checkpoint.VERSION == 2
    assert checkpoint.read(path, CARDS) == restored
