"""Device memory under the hook: the limit is exact, shared by processes and threads, reported
to frameworks and NVML, counted on every allocation path, and returned when a process dies."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator

import pytest

from testkit.native_kit import (
    CUDA_ERROR_OUT_OF_MEMORY,
    CUDA_SUCCESS,
    MIB,
    Kit,
    sanitized_kit,
)

LIMIT = 100 * MIB
MODES = ["proc", "proc-ptds", "proc-v1", "dlsym", "direct"]


@pytest.fixture
def kit() -> Iterator[Kit]:
    k = sanitized_kit()
    k.reset()
    k.write_limits(LIMIT)
    yield k
    k.reset()


@pytest.mark.parametrize("mode", MODES)
def test_last_allocation_that_fits_succeeds_and_the_next_fails(kit: Kit, mode: str) -> None:
    out = kit.probe("init", f"alloc:{LIMIT - MIB}", f"alloc:{MIB}", "alloc:1", mode=mode)
    assert out.rcs("alloc") == [CUDA_SUCCESS, CUDA_SUCCESS, CUDA_ERROR_OUT_OF_MEMORY]


@pytest.mark.parametrize("mode", MODES)
def test_frees_return_exactly_what_was_charged(kit: Kit, mode: str) -> None:
    out = kit.probe(
        "init", f"alloc:{LIMIT}", "free", f"alloc:{LIMIT // 2}", f"alloc:{LIMIT // 2}", mode=mode
    )
    assert out.rcs("alloc") == [CUDA_SUCCESS] * 3
    assert out.rcs("free") == [CUDA_SUCCESS]


@pytest.mark.parametrize("mode", MODES)
def test_reported_memory_is_the_share(kit: Kit, mode: str) -> None:
    out = kit.probe(
        "init", "info", "total", f"alloc:{30 * MIB}", "info", "info1", "total1", "nvml", mode=mode
    )
    assert out.values("info") == [[0, LIMIT, LIMIT], [0, LIMIT - 30 * MIB, LIMIT]]
    assert out.one("info1") == [0, LIMIT - 30 * MIB, LIMIT]
    assert out.one("total") == [0, LIMIT]
    assert out.one("total1") == [0, LIMIT]
    # nvmlDeviceGetMemoryInfo and _v2: total, free, used of the container, not the card.
    share = [LIMIT, LIMIT - 30 * MIB, 30 * MIB]
    assert out.one("nvml") == [0, *share, *share]


def test_a_share_larger_than_the_card_reports_the_card(kit: Kit) -> None:
    kit.write_limits(64 * 1024 * MIB)
    out = kit.probe("init", "info", env={"FAKE_CUDA_MEMORY_MIB": "1024"})
    assert out.one("info") == [0, 1024 * MIB, 1024 * MIB]


# (op, what the hook charges for it): pitch rows are padded to 512 bytes by the fake driver,
# arrays are texel bytes (FLOAT, one channel), mipmaps the sum of their levels.
PATHS = [
    (f"alloc:{10 * MIB}", 10 * MIB),
    (f"alloc1:{10 * MIB}", 10 * MIB),
    ("pitch:1000:1024", 1024 * 1024),
    (f"managed:{10 * MIB}", 10 * MIB),
    (f"vmm:{10 * MIB}", 10 * MIB),
    ("array:1024:1024", 4 * MIB),
    ("array3d:256:256:16", 4 * MIB),
    ("mipmap:1024:1024:3", 4 * MIB + MIB + MIB // 4),
]


@pytest.mark.parametrize(("op", "charged"), PATHS, ids=[p[0].split(":")[0] for p in PATHS])
@pytest.mark.parametrize("mode", ["proc", "direct"])
def test_every_allocation_path_is_counted(kit: Kit, mode: str, op: str, charged: int) -> None:
    name = op.split(":", maxsplit=1)[0]
    out = kit.probe("init", op, "info", "free", "info", mode=mode)
    assert out.rcs(name) == [CUDA_SUCCESS]
    assert out.values("info") == [[0, LIMIT - charged, LIMIT], [0, LIMIT, LIMIT]]


@pytest.mark.parametrize("op", PATHS, ids=[p[0].split(":")[0] for p in PATHS])
def test_every_allocation_path_is_refused_beyond_the_limit(kit: Kit, op: tuple[str, int]) -> None:
    kit.write_limits(op[1] - 1)
    out = kit.probe("init", op[0], "info")
    assert out.rcs(op[0].split(":")[0]) == [CUDA_ERROR_OUT_OF_MEMORY]
    assert out.one("info") == [0, op[1] - 1, op[1] - 1]


@pytest.mark.parametrize("op", ["async", "pool"])
def test_stream_ordered_allocations_count_what_the_pool_reserves(kit: Kit, op: str) -> None:
    # The fake pool grows in 32 MiB chunks and keeps freed memory until trimmed, as real pools do.
    out = kit.probe(
        "init", f"{op}:{MIB}", "info", f"{op}:{MIB}", "info", "freeall", "info", "trim", "info"
    )
    assert out.rcs(op) == [CUDA_SUCCESS, CUDA_SUCCESS]
    free = [v[1] for v in out.values("info")]
    assert free == [LIMIT - 32 * MIB, LIMIT - 32 * MIB, LIMIT - 32 * MIB, LIMIT]


def test_either_family_of_free_releases_the_charge(kit: Kit) -> None:
    out = kit.probe(
        "init", f"alloc:{60 * MIB}", "freeasync", "info", f"async:{MIB}", "freesync", "trim",
        "info",
    )  # fmt: skip
    assert out.rcs("freeasync") == out.rcs("freesync") == [CUDA_SUCCESS]
    assert [v[1] for v in out.values("info")] == [LIMIT, LIMIT]


def test_oversized_requests_do_not_wrap_around(kit: Kit) -> None:
    # 2^32 x 2^32 texels x 4 bytes overflows 64 bits: refused, not charged as a small number.
    out = kit.probe("init", f"array:{2**32}:{2**32}", f"pitch:{2**40}:{2**40}", "info")
    assert out.rcs("array") == out.rcs("pitch") == [CUDA_ERROR_OUT_OF_MEMORY]
    assert out.one("info")[1] == LIMIT


def test_pool_growth_beyond_the_limit_is_refused(kit: Kit) -> None:
    # 3 chunks of 32 MiB fit in 100 MiB, the fourth does not, whatever the request size.
    out = kit.probe("init", *[f"pool:{32 * MIB}"] * 4, "info", "pooldestroy", "info")
    assert out.rcs("pool") == [CUDA_SUCCESS] * 3 + [CUDA_ERROR_OUT_OF_MEMORY]
    assert [v[1] for v in out.values("info")] == [LIMIT - 96 * MIB, LIMIT]


def test_threads_racing_for_the_last_bytes_never_exceed_the_limit(kit: Kit) -> None:
    out = kit.probe("init", f"threads:8:{3 * MIB}", "info")
    (total,) = out.one("threads")
    assert LIMIT - 8 * 3 * MIB <= total <= LIMIT
    assert out.one("info")[1] == LIMIT - total


def _start(kit: Kit, *ops: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        kit.command(["init", *ops, "ready"]),
        env=kit.env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_ready(proc: subprocess.Popen[str]) -> list[str]:
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        if line.strip() == "ready":
            return lines
        lines.append(line.strip())
    raise AssertionError(f"probe ended before ready: {lines} {proc.stderr}")


def test_processes_racing_for_the_last_bytes_never_exceed_the_limit(kit: Kit) -> None:
    procs = [_start(kit, f"fill:{MIB}") for _ in range(6)]
    try:
        counts = []
        for p in procs:
            lines = _wait_ready(p)
            fill = [line.split() for line in lines if line.startswith("fill ")]
            counts.append(int(fill[0][1]))
        total = sum(counts) * MIB
        assert LIMIT - 6 * MIB <= total <= LIMIT
        out = kit.probe("init", "info", "alloc:1")
        assert out.one("info")[1] == LIMIT - total
    finally:
        for p in procs:
            p.kill()
            p.communicate()


def test_a_killed_process_leaks_nothing(kit: Kit) -> None:
    holder = _start(kit, f"alloc:{LIMIT}")
    try:
        _wait_ready(holder)
        assert kit.probe("init", "alloc:1").rcs("alloc") == [CUDA_ERROR_OUT_OF_MEMORY]
        holder.send_signal(signal.SIGKILL)
        holder.communicate()
        out = kit.probe("init", "info", f"alloc:{LIMIT}")
        assert out.one("info")[1] == LIMIT
        assert out.rcs("alloc") == [CUDA_SUCCESS]
    finally:
        holder.kill()
        holder.communicate()


def test_a_process_that_exits_gives_its_share_back(kit: Kit) -> None:
    kit.probe("init", f"alloc:{LIMIT}")  # exits without freeing
    assert kit.probe("init", f"alloc:{LIMIT}").rcs("alloc") == [CUDA_SUCCESS]


def test_the_share_is_per_card_in_the_grant(kit: Kit) -> None:
    # A card the container was not granted gets nothing: its UUID is not in the limits file.
    kit.write_limits(LIMIT, devices=("GPU-00000000-0000-0000-0000-000000000000",))
    out = kit.probe("init", "alloc:1", "info")
    assert out.rcs("alloc") == [CUDA_ERROR_OUT_OF_MEMORY]
    assert out.one("info") == [0, 0, 0]
