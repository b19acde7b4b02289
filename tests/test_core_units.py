"""core/units.py: the one parser for cards and for MiB, through both sources that use it.

Each case runs through a pod's and a GPUQuota's rules, so the table shows in one place which
spellings the two accept alike and where they differ (core/units.py's docstring says why).
"""

from __future__ import annotations

from typing import Any

import pytest

from core.units import Source, UnitError, cards_phrase, cards_text, parse_cards, parse_mib

REJECT = None  # the parser raises UnitError

# raw value, hundredths in a pod, hundredths in a GPUQuota
CARDS = [
    pytest.param("0.3", 30, 30, id="fraction"),
    pytest.param("300m", 30, 30, id="fraction as the apiserver re-serialises it"),
    pytest.param(0.25, 25, 25, id="YAML float"),
    pytest.param("1", 100, 100, id="one card"),
    pytest.param(4, 400, 400, id="whole cards as int"),
    pytest.param("0", 0, 0, id="zero"),
    pytest.param("4.5", REJECT, 450, id="more than one card with a fraction: quota only"),
    pytest.param("1.5", REJECT, 150, id="one and a half: quota only"),
    pytest.param("0.333", REJECT, REJECT, id="three decimals"),
    pytest.param("1e-3", REJECT, REJECT, id="a thousandth"),
    pytest.param("-1", REJECT, REJECT, id="negative"),
    pytest.param("1Gi", REJECT, REJECT, id="binary suffix"),
    pytest.param("abc", REJECT, REJECT, id="not a quantity"),
    pytest.param(True, REJECT, REJECT, id="boolean"),
    pytest.param(None, REJECT, REJECT, id="null"),
]

# raw value, MiB in a pod, MiB in a GPUQuota
MIB = [
    pytest.param(8192, 8192, 8192, id="plain int is MiB"),
    pytest.param("3000", 3000, 3000, id="plain text is MiB"),
    pytest.param("8Gi", 8192, 8192, id="binary suffix is bytes"),
    pytest.param("2048Ki", 2, 2, id="kibibytes that are whole MiB"),
    pytest.param("0", 0, 0, id="zero"),
    pytest.param("3k", 3000, REJECT, id="decimal suffix: pod only (the apiserver writes 3000 so)"),
    pytest.param("1e3", 1000, REJECT, id="exponent: pod only"),
    pytest.param("2000m", 2, REJECT, id="milli that is whole: pod only"),
    pytest.param("64G", 64 * 10**9, REJECT, id="decimal giga: pod reads the number, quota refuses"),
    pytest.param("1Ki", REJECT, REJECT, id="not a whole MiB"),
    pytest.param("1.5", REJECT, REJECT, id="fractional MiB"),
    pytest.param("1.5Mi", REJECT, REJECT, id="fractional MiB in bytes"),
    pytest.param("-5", REJECT, REJECT, id="negative"),
    pytest.param("x", REJECT, REJECT, id="not a quantity"),
]


def _by_source(table: list[Any]) -> list[Any]:
    """Each row once per source: ``(raw, source, expected)``, named ``<row> / in a <source>``."""
    return [
        pytest.param(row.values[0], source, expected, id=f"{row.id} / in a {source}")
        for row in table
        for source, expected in zip(("pod", "quota"), row.values[1:], strict=True)
    ]


@pytest.mark.parametrize(("raw", "source", "expected"), _by_source(CARDS))
def test_cards(raw: object, source: Source, expected: int | None) -> None:
    if expected is REJECT:
        with pytest.raises(UnitError, match="at most two decimals"):
            parse_cards(raw, source=source)
    else:
        assert parse_cards(raw, source=source) == expected


@pytest.mark.parametrize(("raw", "source", "expected"), _by_source(MIB))
def test_mib(raw: object, source: Source, expected: int | None) -> None:
    if expected is REJECT:
        with pytest.raises(UnitError, match="whole number of MiB"):
            parse_mib(raw, source=source)
    else:
        assert parse_mib(raw, source=source) == expected


@pytest.mark.parametrize(
    ("core", "text", "phrase"),
    [
        pytest.param(370, "3.70", "3.70 cards", id="several cards"),
        pytest.param(50, "0.50", "0.50 card", id="a share"),
        pytest.param(100, "1.00", "1.00 card", id="one card is singular"),
        pytest.param(400, "4.00", "4.00 cards", id="whole cards"),
    ],
)
def test_display(core: int, text: str, phrase: str) -> None:
    assert cards_text(core) == text
    assert cards_phrase(core) == phrase
