from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from deviceplugin.classic.ids import MAX_ID_LENGTH, DeviceId, DeviceIdError, Kind


@given(st.integers(0, 9999), st.sampled_from(list(Kind)), st.integers(0, 9_999_999))
def test_ids_round_trip_and_fit_kubelet_limit(card: int, kind: Kind, number: int) -> None:
    device = DeviceId(card, kind, number)
    assert DeviceId.parse(str(device)) == device
    assert len(str(device)) <= MAX_ID_LENGTH


@pytest.mark.parametrize("text", ["", "g0", "g0-x1", "g01-c1", "g0-c01", "G0-c1", "g0-c1 ", "gpu"])
def test_foreign_ids_are_refused(text: str) -> None:
    with pytest.raises(DeviceIdError, match="not a fracgpu ID"):
        DeviceId.parse(text)
