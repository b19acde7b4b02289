"""The limits-file contract, Python side (the C side is checked in tests/test_native_*.py)."""

from pathlib import Path

import pytest

from core.contract import Limits, LimitsError, c_header


@pytest.mark.parametrize("durable", [False, True])
def test_round_trip(tmp_path: Path, durable: bool) -> None:
    limits = Limits(("GPU-1234", "GPU-abcd"), 8 << 30, 30)
    path = limits.write_atomic(tmp_path, durable=durable)
    assert Limits.parse(path.read_text()) == limits
    assert path.stat().st_mode & 0o777 == 0o644
    assert [p.name for p in tmp_path.iterdir()] == ["limits"]


@pytest.mark.parametrize(
    "text",
    [
        "",
        "version=1\ndevices=GPU-1\nmemory_bytes=1\n",
        "version=2\ndevices=GPU-1\nmemory_bytes=1\ncompute_percent=1\n",
        "version=1\ndevices=GPU-1\nmemory_bytes=1\ncompute_percent=101\n",
        "version=1\ndevices=GPU-1\nmemory_bytes=0\ncompute_percent=5\n",
        "version=1\ndevices=\nmemory_bytes=1\ncompute_percent=5\n",
        "version=1\nversion=1\ndevices=GPU-1\nmemory_bytes=1\ncompute_percent=5\n",
        "version=1\ndevices=GPU-1\nmemory_bytes=x\ncompute_percent=5\n",
        "version=1\ndevices=GPU-1\nmemory_bytes=1\ncompute_percent=5\nextra=1\n",
        "x" * 5000,
    ],
    ids=[
        "empty",
        "no compute_percent",
        "version 2",
        "compute over 100",
        "zero memory",
        "no devices",
        "a key twice",
        "memory not a number",
        "an unknown key",
        "over the size bound",
    ],
)
def test_rejects(text: str) -> None:
    with pytest.raises(LimitsError):
        Limits.parse(text)


def test_header_names_every_key() -> None:
    header = c_header()
    for key in ("version", "devices", "memory_bytes", "compute_percent", "/run/fracgpu/limits"):
        assert f'"{key}"' in header
