"""deviceplugin/shared/sharing.py: after each guard scan, each throttled share's usage file (its
own use, its ceiling from the lending policy and its compute policy), where its hook reads it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from core.contract import USAGE_FILE, Limits, ShareUsage
from core.policy import HARD_CAP, Priority, SharePolicy
from deviceplugin.shared.guardtypes import Owner, Process, Usage
from deviceplugin.shared.inventory import Card
from deviceplugin.shared.sharing import ShareMeter

CARDS = [Card(i, f"GPU-{i}", "H100", 81559, i, None) for i in range(2)]
BURST = SharePolicy(100)
HIGH_BURST = SharePolicy(100, Priority.HIGH)


@dataclass(frozen=True)
class Share:
    """One share as the guard saw it: its guarantee, policy, and SM use per card it ran on."""

    name: str
    guarantee: int
    busy: dict[int, float]  # card -> percent of its SMs busy
    policy: SharePolicy = HARD_CAP
    cards: tuple[int, ...] = (0,)


@dataclass
class Clock:
    now: int = 1_000_000_000

    def __call__(self) -> int:
        return self.now


def scan(
    tmp_path: Path, shares: list[Share], meter: ShareMeter | None = None, clock: Clock | None = None
) -> ShareMeter:
    """Two scans 0.5 s apart (the first only starts the window); the meter."""
    clock = clock or Clock()
    policies = {str(tmp_path / s.name): s.policy for s in shares}
    meter = meter or ShareMeter(lambda owner: policies[owner.grant], clock_us=clock)
    usage, busy = [], {}
    for pid, share in enumerate(shares, start=100):
        directory = tmp_path / share.name
        directory.mkdir(exist_ok=True)
        limits = Limits(tuple(CARDS[c].uuid for c in share.cards), 1 << 30, share.guarantee)
        owner = Owner("team", share.name, "main", f"uid-{pid}", f"c{pid}", limits, str(directory))
        for card, percent in share.busy.items():
            usage.append(Usage(owner, CARDS[card], (Process(pid, 1 << 20, 1),)))
            busy.setdefault(card, {})[pid] = percent
    clock.now += 500_000
    meter.update(usage, busy)
    clock.now += 500_000
    meter.update(usage, busy)
    return meter


def written(tmp_path: Path, name: str) -> tuple[int, int] | None:
    """(used, ceiling) of a share's usage file, or None when none was written."""
    path = tmp_path / name / USAGE_FILE
    if not path.exists():
        return None
    usage = ShareUsage.parse(path.read_text())
    assert usage.window_us == 500_000
    return usage.used_percent, usage.ceiling_percent


CASES = [
    pytest.param(
        [Share("a", 30, {0: 30}), Share("b", 70, {0: 68})],
        {"a": (30, 30), "b": (68, 70)},
        id="two-busy-hard-caps-each-told-its-own-use",
    ),
    pytest.param(
        [Share("a", 30, {0: 29}, BURST)],
        {"a": (29, 100)},
        id="a-bursting-share-alone-is-lent-the-card",
    ),
    pytest.param(
        [Share("a", 30, {0: 29}, SharePolicy(60))],
        {"a": (29, 60)},
        id="lent-no-more-than-its-limit",
    ),
    pytest.param(
        [Share("a", 30, {0: 29}, BURST), Share("b", 70, {0: 50})],
        {"a": (29, 30), "b": (50, 70)},
        id="its-owner-runs-nothing-is-lent",
    ),
    pytest.param(
        [Share("a", 30, {0: 29}, BURST), Share("b", 70, {0: 0})],
        {"a": (29, 100), "b": (0, 70)},
        id="an-idle-owners-guarantee-is-lent",
    ),
    pytest.param(
        [Share("hi", 20, {0: 19}, HIGH_BURST), Share("lo", 20, {0: 19}, BURST)],
        {"hi": (19, 80), "lo": (19, 20)},
        id="high-priority-borrows-first",
    ),
    pytest.param(
        [Share("a", 30, {0: 10}, BURST)],
        {"a": (10, 30)},
        id="a-share-below-its-ceiling-wants-nothing-more",
    ),
    pytest.param(
        [Share("whole", 100, {0: 100})],
        {"whole": None},
        id="an-unthrottled-share-gets-no-file",
    ),
    pytest.param(
        [Share("pair", 30, {0: 10, 1: 28}, BURST, (0, 1)), Share("b", 70, {1: 60})],
        {"pair": (28, 30), "b": (60, 70)},
        id="a-share-of-two-cards-highest-use-lowest-ceiling",
    ),
]


@pytest.mark.parametrize(("shares", "expected"), CASES)
def test_each_throttled_share_is_told_its_use_and_ceiling(
    tmp_path: Path, shares: list[Share], expected: dict[str, tuple[int, int] | None]
) -> None:
    scan(tmp_path, shares)
    assert {name: written(tmp_path, name) for name in expected} == expected


def test_the_first_scan_writes_nothing(tmp_path: Path) -> None:
    """The first scan's samples cover a time the meter does not know."""
    directory = tmp_path / "a"
    directory.mkdir()
    owner = Owner("team", "a", "main", "u", "c", Limits(("GPU-0",), 1 << 30, 30), str(directory))
    meter = ShareMeter()
    assert meter.update([Usage(owner, CARDS[0], (Process(1, 1, 1),))], {0: {1: 30.0}}) == {}
    assert not (directory / USAGE_FILE).exists()


def test_a_card_that_does_not_sample_gets_no_file(tmp_path: Path) -> None:
    """No per-process figure: the hook's own fallback (the card's samples) is better than 0."""
    meter = scan(tmp_path, [Share("a", 30, {})])
    assert meter.written == 0


@pytest.mark.parametrize(
    ("use", "ceiling"),
    [
        pytest.param(50, 100, id="busy-beyond-its-guarantee-stays-lent"),
        pytest.param(12, 30, id="below-its-guarantee-gives-the-loan-back"),
    ],
)
def test_a_lent_ceiling_is_kept_while_its_share_runs_at_it(
    tmp_path: Path, use: float, ceiling: int
) -> None:
    """A loan stays while its share is busy at least at its guarantee, whatever it uses of it
    (no loan won and lost scan after scan), and ends when it is not."""
    clock = Clock()
    meter = scan(tmp_path, [Share("a", 30, {0: 29}, BURST)], clock=clock)
    assert written(tmp_path, "a") == (29, 100)
    scan(tmp_path, [Share("a", 30, {0: use}, BURST)], meter, clock)
    assert written(tmp_path, "a") == (use, ceiling)
