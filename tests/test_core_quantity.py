"""core.quantity.quantity_int: how readers of stored objects take a capacity or a limit."""

from __future__ import annotations

import pytest

from core.quantity import quantity_int


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        pytest.param("30", 30, id="plain"),
        pytest.param("8Gi", 8 * 2**30, id="binary-suffix"),
        pytest.param("81408Mi", 81408 * 2**20, id="card-memory"),
        pytest.param("1500m", 1, id="fraction-is-cut-to-its-whole-part"),
        pytest.param(64, 64, id="json-number"),
        pytest.param(None, None, id="absent"),
        pytest.param("lots", None, id="not-a-quantity"),
        pytest.param(True, None, id="boolean-is-not-a-quantity"),
    ],
)
def test_a_quantity_as_a_whole_number(raw: object, expected: int | None) -> None:
    assert quantity_int(raw) == expected
