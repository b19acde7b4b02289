"""How programs reach the hook: direct calls, dlsym, cuGetProcAddress (every version and flag);
and what the hook must not disturb in programs that never touch a GPU."""

from __future__ import annotations

import subprocess

import pytest

from testkit.native_kit import (
    CUDA_ERROR_OUT_OF_MEMORY,
    MIB,
    Kit,
    release_kit,
    sanitized_kit,
)


@pytest.mark.parametrize("mode", ["proc", "proc-ptds", "proc-v1", "dlsym", "direct"])
@pytest.mark.parametrize("hooked", [True, False], ids=["hooked", "unhooked"])
def test_each_way_to_the_driver_goes_through_the_hook(kit: Kit, mode: str, hooked: bool) -> None:
    kit.write_limits(MIB)
    out = kit.probe("init", f"alloc:{2 * MIB}", "info", mode=mode, hooked=hooked)
    # Without the hook the same program gets the whole fake card: the probe really is able to
    # tell the two apart.
    if hooked:
        assert out.rcs("alloc") == [CUDA_ERROR_OUT_OF_MEMORY]
        assert out.one("info")[2] == MIB
    else:
        assert out.rcs("alloc") == [0]
        assert out.one("info")[2] == 16384 * MIB


@pytest.mark.parametrize("build", ["sanitized", "release"])
def test_dlsym_rtld_next_still_means_after_the_caller(build: str) -> None:
    # libnext's abs() wraps libc's with dlsym(RTLD_NEXT); through the hook's dlsym it must still
    # reach libc (1007), not itself (-12345) or crash. Both builds: the forwarding relies on the
    # compiler emitting a tail call, which optimisation levels could change.
    kit = sanitized_kit() if build == "sanitized" else release_kit()
    out = subprocess.run(
        [str(kit.build / "next_user")], env=kit.env(), capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "abs 1007"


def test_programs_without_a_gpu_run_untouched(kit: Kit) -> None:
    kit.write_limits(MIB, 30)
    out = subprocess.run(
        ["sh", "-c", "echo hello | tr a-z A-Z"],
        # (the shell's own leaks at exit are not ours to report)
        env=kit.env(extra={"ASAN_OPTIONS": "detect_leaks=0"}),
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout == "HELLO\n"
    assert out.stderr == ""
    # Nothing was created: the hook initialises on the first driver call, not at load.
    assert not kit.region.exists()


def test_sibling_processes_share_one_limit(kit: Kit) -> None:
    # Two probes started together from one shell: each takes its own slot, and one limit binds both.
    kit.write_limits(10 * MIB)
    cmd = " & ".join(
        " ".join(kit.command(["init", f"alloc:{6 * MIB}", "sleep:300"])) for _ in range(2)
    )
    out = subprocess.run(
        ["sh", "-c", cmd + " & wait"], env=kit.env(), capture_output=True, text=True, check=True
    )
    assert sorted(line for line in out.stdout.splitlines() if line.startswith("alloc")) == [
        "alloc 0",
        "alloc 2",
    ]


@pytest.mark.parametrize("mode", ["proc", "proc-ptds", "proc-v1"])
def test_cugetprocaddress_entry_points_other_than_the_exports_are_still_hooked(
    kit: Kit, mode: str
) -> None:
    # The fake then hands out internal addresses for cuMemAlloc_v2, cuMemFree_v2,
    # cuMemGetInfo_v2 and cuMemAllocAsync_ptsz; the hook falls back to the variant's name.
    kit.write_limits(10 * MIB)
    internal = {"FAKE_CUDA_PROC_INTERNAL": "1"}
    out = kit.probe(
        "init", f"alloc:{10 * MIB}", "alloc:1", "async:1", "info", "free", "info",
        mode=mode, env=internal,
    )  # fmt: skip
    assert out.rcs("alloc") == [0, CUDA_ERROR_OUT_OF_MEMORY]
    assert out.rcs("async") == [CUDA_ERROR_OUT_OF_MEMORY]
    assert out.values("info") == [[0, 0, 10 * MIB], [0, 10 * MIB, 10 * MIB]]


def test_a_forked_child_is_accounted_apart_from_its_parent(kit: Kit) -> None:
    # The child takes its own slot (pthread_atfork): its allocation counts against the same
    # limit, and its exit returns its share without touching the parent's.
    kit.write_limits(100 * MIB)
    out = kit.probe(
        "init", f"alloc:{60 * MIB}", f"fork-alloc:{50 * MIB}", f"fork-alloc:{30 * MIB}", "info"
    )
    assert out.rcs("child-alloc") == [CUDA_ERROR_OUT_OF_MEMORY, 0]
    assert out.rcs("fork-alloc") == [0, 0]
    assert out.one("info") == [0, 40 * MIB, 100 * MIB]


def test_a_card_outside_the_grant_is_named_once(kit: Kit) -> None:
    kit.write_limits(MIB, devices=("GPU-00000000-0000-0000-0000-000000000000",))
    out = kit.probe("init", "alloc:1", "alloc:1", "info")
    (message,) = out.hook_messages
    assert "GPU-10111213-1415-1617-1819-1a1b1c1d1e00" in message
    assert "not in the limits" in message
