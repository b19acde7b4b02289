"""The limits-file contract, Python side (the C side is checked in tests/test_native_*.py)."""

from pathlib import Path

import pytest

from core.contract import USAGE_MAX_WINDOW_US, Limits, LimitsError, ShareUsage, c_header


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


def test_usage_round_trip(tmp_path: Path) -> None:
    usage = ShareUsage(1_764_230_400_000_000, 100_000, 27, 30)
    path = usage.write_atomic(tmp_path)
    assert path.name == "usage"
    assert ShareUsage.parse(path.read_text()) == usage
    assert path.stat().st_mode & 0o777 == 0o644


@pytest.mark.parametrize(
    ("stamp", "window", "used", "ceiling"),
    [
        (0, 1, 0, 1),
        (10, 11, 0, 1),
        (10**9, 0, 0, 1),
        (10**9, USAGE_MAX_WINDOW_US + 1, 0, 1),
        (10**9, 1, 101, 1),
        (10**9, 1, -1, 1),
        (10**9, 1, 0, 0),
        (10**9, 1, 0, 101),
    ],
    ids=[
        "no stamp",
        "window before the epoch",
        "empty window",
        "window too long",
        "used over 100",
        "used negative",
        "ceiling 0",
        "ceiling over 100",
    ],
)
def test_usage_refuses_out_of_range(stamp: int, window: int, used: int, ceiling: int) -> None:
    with pytest.raises(LimitsError):
        ShareUsage(stamp, window, used, ceiling)


@pytest.mark.parametrize(
    "text",
    [
        "version=1\nstamp_us=5\nwindow_us=1\nused_percent=0\nceiling_percent=1\nextra=1\n",
        "version=1\nstamp_us=5\nwindow_us=1\nused_percent= 1\nceiling_percent=1\n",
        "version=1\nstamp_us=5\nwindow_us=1\nused_percent=1.5\nceiling_percent=1\n",
        "version=1\nstamp_us=5\nwindow_us=1\nused_percent=١\nceiling_percent=1\n",
    ],
    ids=["unknown key", "space in a number", "fraction", "non-ASCII digit"],
)
def test_usage_parse_is_strict(text: str) -> None:
    with pytest.raises(LimitsError):
        ShareUsage.parse(text)


def test_header_names_the_usage_keys() -> None:
    header = c_header()
    for key in ("usage", "stamp_us", "window_us", "used_percent", "ceiling_percent"):
        assert f'"{key}"' in header
