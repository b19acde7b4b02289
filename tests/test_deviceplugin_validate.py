"""Which device IDs a request may hold (validate): tables of IDs against a two-card node."""

from __future__ import annotations

import pytest

from deviceplugin.classic.allocation import AllocationError
from deviceplugin.classic.ids import Kind, core_id, memory_id
from deviceplugin.classic.validate import check, known

BLOCKS = {0: 4, 1: 8}  # card index -> memory IDs it lists
RESOURCE = "fracgpu.io/x"

KNOWN = [
    pytest.param(Kind.CORE, core_id(0, 0), True, id="first core ID"),
    pytest.param(Kind.CORE, core_id(1, 99), True, id="last core ID"),
    pytest.param(Kind.CORE, core_id(1, 100), False, id="core past the card"),
    pytest.param(Kind.CORE, core_id(2, 0), False, id="no such card"),
    pytest.param(Kind.MEMORY, memory_id(0, 3), True, id="last memory block"),
    pytest.param(Kind.MEMORY, memory_id(0, 4), False, id="memory past a small card"),
    pytest.param(Kind.MEMORY, memory_id(1, 7), True, id="the larger card's block"),
    pytest.param(Kind.MEMORY, core_id(0, 0), False, id="the other resource"),
    pytest.param(Kind.CORE, "gpu-0", False, id="not a fracgpu ID"),
]


@pytest.mark.parametrize(("kind", "text", "expected"), KNOWN)
def test_known(kind: Kind, text: str, expected: bool) -> None:
    assert known(kind, text, BLOCKS) is expected


def cores(card: int, n: int, start: int = 0) -> list[str]:
    return [core_id(card, i) for i in range(start, start + n)]


ACCEPTED = [
    pytest.param(Kind.CORE, cores(0, 30), id="a share"),
    pytest.param(Kind.CORE, cores(0, 99), id="the largest share"),
    pytest.param(Kind.CORE, cores(0, 100), id="one whole card"),
    pytest.param(Kind.CORE, cores(0, 100) + cores(1, 100), id="both whole cards"),
    pytest.param(Kind.MEMORY, [memory_id(0, 0), memory_id(1, 7)], id="memory of two cards"),
]


@pytest.mark.parametrize(("kind", "ids"), ACCEPTED)
def test_check_accepts(kind: Kind, ids: list[str]) -> None:
    check(kind, ids, RESOURCE, BLOCKS)


REFUSED = [
    pytest.param(Kind.CORE, [], "holds no device IDs", id="empty"),
    pytest.param(Kind.CORE, ["nonsense"], "is not a fracgpu ID", id="not an ID"),
    pytest.param(Kind.CORE, [core_id(0, 1)] * 2, "appears twice", id="twice"),
    pytest.param(Kind.CORE, [memory_id(0, 1)], "the other fracgpu resource", id="other kind"),
    pytest.param(Kind.MEMORY, [memory_id(0, 4)], "unknown on this node", id="past the card"),
    pytest.param(Kind.CORE, [core_id(5, 0)], "unknown on this node", id="no such card"),
    pytest.param(Kind.CORE, cores(0, 100) + cores(1, 50), "neither a share", id="not whole cards"),
]


@pytest.mark.parametrize(("kind", "ids", "message"), REFUSED)
def test_check_refuses(kind: Kind, ids: list[str], message: str) -> None:
    with pytest.raises(AllocationError, match=message) as caught:
        check(kind, ids, RESOURCE, BLOCKS)
    assert str(caught.value).startswith(f"{RESOURCE}: ")
