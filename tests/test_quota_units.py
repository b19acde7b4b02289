"""Quota units: cards and MiB as users write them, and as messages print them."""

import pytest

from quota.units import UnitError, cards_phrase, cards_text, parse_cards, parse_memory_mib


@pytest.mark.parametrize(
    ("raw", "hundredths"),
    [("4.5", 450), (4, 400), (4.5, 450), ("0.25", 25), ("300m", 30), ("0", 0), ("12", 1200)],
)
def test_cards(raw: object, hundredths: int) -> None:
    assert parse_cards(raw) == hundredths


@pytest.mark.parametrize("raw", ["4.555", "-1", "1Gi", "abc", True, None, "1e-3"])
def test_bad_cards(raw: object) -> None:
    with pytest.raises(UnitError, match="at most two decimals"):
        parse_cards(raw)


@pytest.mark.parametrize(
    ("raw", "mib"), [(65536, 65536), ("64Gi", 65536), ("512Mi", 512), ("2048Ki", 2), ("3000", 3000)]
)
def test_memory(raw: object, mib: int) -> None:
    assert parse_memory_mib(raw) == mib


@pytest.mark.parametrize("raw", ["1Ki", "1.5", "-5", "64G", "1.5Mi", "x"])
def test_bad_memory(raw: object) -> None:
    with pytest.raises(UnitError, match="whole number of MiB"):
        parse_memory_mib(raw)


def test_display() -> None:
    assert cards_text(370) == "3.70"
    assert cards_phrase(50) == "0.50 card"
    assert cards_phrase(100) == "1.00 card"
    assert cards_phrase(400) == "4.00 cards"
