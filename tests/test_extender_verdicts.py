"""The verdicts filter keeps per node and pod shape: kept while the node's cards and ledger are
the same objects, computed again when either is replaced, never kept for a pod that has a
booking of its own there."""

from __future__ import annotations

from dataclasses import replace

import pytest

from core.placement import ContainerPlacement
from extender.demand import pod_demand
from extender.ledger import Booking, Ledger
from extender.verbs import Verdicts
from extender.view import judge, node_cards
from testkit.extender import Gpu, node, pod

CARDS = node_cards(node("n", Gpu("G-0"), Gpu("G-1")))
LEDGER = Ledger("n", {"u-other": Booking("t", "o", {"c": ContainerPlacement(("G-0",), 60, 0)})})
DEMAND = pod_demand(pod("p", (50, 0), uid="u-p"), ())
OWN = Ledger("n", {"u-p": Booking("t", "p", {"c": ContainerPlacement(("G-1",), 50, 0)})})


@pytest.mark.parametrize(
    ("second", "computed"),
    [
        pytest.param(lambda: (CARDS, LEDGER), 1, id="same-objects-kept"),
        pytest.param(lambda: (CARDS, replace(LEDGER, version="2")), 2, id="ledger-replaced"),
        pytest.param(lambda: (replace(CARDS), LEDGER), 2, id="cards-replaced"),
    ],
)
def test_a_verdict_is_kept_only_for_the_same_objects(second: object, computed: int) -> None:
    verdicts = Verdicts()
    assert CARDS is not None
    first = verdicts.judge("n", CARDS, LEDGER, DEMAND)
    cards, ledger = second()  # type: ignore[operator]
    again = verdicts.judge("n", cards, ledger, DEMAND)
    assert verdicts.hits == 2 - computed
    assert again == judge(cards, ledger, DEMAND) and first.fits


def test_a_pod_with_its_own_booking_is_judged_afresh() -> None:
    verdicts = Verdicts()
    for _ in range(3):
        verdict = verdicts.judge("n", CARDS, OWN, DEMAND)
        assert verdict == judge(CARDS, OWN, DEMAND)
    assert verdicts.hits == 0


def test_the_kept_verdicts_are_bounded() -> None:
    verdicts = Verdicts(limit=2)
    for i in range(5):
        verdicts.judge(f"n{i}", CARDS, LEDGER, DEMAND)
    assert len(verdicts._kept) <= 2
