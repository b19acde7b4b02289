"""The hook's memory families (native/src/memory*.c) on their own: each file's C unit test links
it with the core (memory.c), the real record table and a scripted driver, so a charge, a refusal
or a release that goes wrong is caught in the family's own code rather than only through the
fake driver end to end. Built with the sanitizers in the session's native kit, every unit test
must report every case ok."""

from __future__ import annotations

import functools
import subprocess

import pytest

from testkit.native_kit import sanitized_kit

# Each unit test binary and the cases it prints "ok <case>" for, in the order it runs them.
UNITS: dict[str, list[str]] = {
    # memory.c: the card, the charge, fg_alloc_charged, fg_free_recorded, the reset after fork
    "memory_core_test": [
        "an ungranted card is named once",
        "card index by uuid",
        "the current context's card",
        "charge up to the limit, never past it",
        "alloc charged: exact",
        "alloc charged: settles down on what the driver took",
        "alloc charged: settles up while it fits",
        "alloc charged: settling past the limit is undone",
        "alloc charged: refused before the driver",
        "alloc charged: the driver's refusal releases",
        "alloc charged: an ungranted card is refused",
        "alloc charged: deny mode refuses",
        "free recorded: releases the record's charge",
        "free recorded: a refused free keeps the charge",
        "free recorded: an unknown key releases nothing",
        "free recorded: inert takes no record",
        "a forked child starts from empty tables",
    ],
    # memory_linear.c: cuMemAlloc(_v2), cuMemAllocManaged, cuMemAllocPitch(_v2), frees, cuCtxDestroy
    "memory_linear_test": [
        "charged by size on either card, freed exactly",
        "the last byte fits, the next never reaches the driver",
        "the driver's refusal returns the charge",
        "enforced: charged",
        "inert: passed through uncharged",
        "deny: refused before the driver",
        "an ungranted card: refused before the driver",
        "no context: the driver answers, uncharged",
        "zero bytes: the driver answers, uncharged",
        "pitch: settled on the driver's 512-byte pitch",
        "pitch: a finer pitch settles down",
        "pitch: a coarser pitch settles up",
        "pitch: settling up past the limit frees it",
        "pitch: the padded worst case is charged first",
        "pitch: an overflowing size is refused",
        "legacy pitch: settled on the driver's pitch",
        "legacy pitch: settling up past the limit frees it",
        "a refused free keeps the charge",
        "a free of memory never charged releases nothing",
        "cuCtxDestroy returns that context's linear memory only",
    ],
    # memory_pool.c: stream-ordered allocations, charged by what their pool reserves
    "memory_pool_test": [
        "charged by the pool's reserve: a free keeps it, a trim returns it",
        "the whole share fits",
        "growth past the limit never reaches the driver",
        "chunk rounding past the limit: freed, trimmed, refused",
        "the driver's refusal settles back",
        "inert: passed through uncharged",
        "deny: refused before the driver",
        "an ungranted context: refused before the driver",
        "no context: the driver answers, uncharged",
        "zero bytes: the driver answers, uncharged",
        "a pool's memory is charged to the pool's card, not the context's",
        "a pool on an ungranted card gets nothing",
        "a pool of host memory is not the card's",
        "destroy returns the pool's charge, a failed one keeps it",
        "a pool the hook cannot track is destroyed and refused",
        "cuMemFreeAsync settles a linear or a pool record; a refused one keeps it",
        "captured: the graph's bytes, and no pool query",
        "a forked child forgets the parent's pools",
    ],
    # memory_vmm.c: cuMemCreate handles, release, export, mappings (own and imported)
    "memory_vmm_test": [
        "create: charged by size on its card",
        "create: the whole share fits",
        "create: past the limit refused before the driver",
        "create: an ungranted card is refused",
        "create: host memory is not the card's",
        "create: the driver's refusal returns the charge",
        "released, never mapped: the charge goes",
        "released while mapped: charged until the last unmap",
        "unmapped, then released: the charge goes at the release",
        "one unmap covering both mappings",
        "mapped again after an unmap",
        "exported: charged while the process lives",
        "exported after its release, while mapped: still kept",
        "imported: charged by the mapping's size on the handle's card",
        "imported: past the limit refused before the driver",
        "imported: an ungranted card is refused",
        "imported: a handle on no card is refused",
        "imported: the driver's refusal returns the charge",
        "a refused release keeps the charge",
        "inert: create, map, unmap and release pass through uncharged",
        "a forked child forgets the parent's handles and mappings",
    ],
    # memory_array.c: arrays and mipmapped arrays, by texel bytes
    "memory_array_test": [
        "2D: width x height x texel",
        "1D: no height counts as one row",
        "no channels count as one",
        "16-bit signed texels",
        "an unknown format counts the widest texel",
        "3D: width x height x depth x texel",
        "3D without depth is one layer",
        "legacy 2D descriptor",
        "legacy 3D descriptor",
        "mipmap: each level halves",
        "mipmap: no levels count as one",
        "mipmap: sizes stop at one texel",
        "mipmap: 3D levels halve depth too",
        "mipmap: at most 64 levels",
        "an overflowing size is refused",
        "an overflowing mipmap is refused",
        "enforced: charged until destroyed",
        "past the limit: refused before the driver",
        "the driver's refusal returns the charge",
        "inert: passed through uncharged",
        "deny: refused before the driver",
        "an ungranted card: refused before the driver",
        "no context: the driver answers, uncharged",
        "no descriptor: the driver answers, uncharged",
        "an array and a mipmap with the same handle are charged apart",
        "a refused destroy keeps the charge",
    ],
    # memory_info.c: cuMemGetInfo, cuDeviceTotalMem and NVML memory info report the share
    "memory_info_test": [
        "a share below the card: the share, less the container's use",
        "the card's free memory bounds what is left of the share",
        "a share larger than the card: the card",
        "use beyond the share leaves nothing free",
        "each card's use is its own",
        "deny: nothing",
        "an ungranted card: nothing",
        "inert: the card as it is",
        "no context: the driver's answer, untouched",
    ],
}


@functools.cache
def report(unit: str) -> subprocess.CompletedProcess[str]:
    """One run of a unit test per session: every test below reads the same report."""
    kit = sanitized_kit()
    return subprocess.run(
        [str(kit.build / unit)],
        env=kit.env(hooked=False),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize("unit", UNITS)
def test_the_unit_test_exits_cleanly(unit: str) -> None:
    """The exit status counts the failed cases; a crash mid-way is caught here too."""
    result = report(unit)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("unit", UNITS)
def test_the_sanitizers_report_nothing(unit: str) -> None:
    """A leak or undefined behaviour in a family's code fails it even where the sums come out."""
    result = report(unit)
    assert "Sanitizer" not in result.stderr, result.stderr
    assert "runtime error:" not in result.stderr, result.stderr


@pytest.mark.parametrize("unit", UNITS)
def test_every_case_it_runs_is_listed(unit: str) -> None:
    """A case added to or renamed in the C file must be named here, so that none runs unseen."""
    lines = report(unit).stdout.splitlines()
    passed = [line.removeprefix("ok ") for line in lines if line.startswith("ok ")]
    assert [case for case in passed if case not in UNITS[unit]] == [], report(unit).stdout


@pytest.mark.parametrize(
    ("unit", "case"),
    [
        pytest.param(unit, case, id=f"{unit}-{case.replace(' ', '-')}")
        for unit, cases in UNITS.items()
        for case in cases
    ],
)
def test_each_case_passes(unit: str, case: str) -> None:
    """Named one by one, so that a failure says which behaviour broke."""
    assert f"ok {case}" in report(unit).stdout.splitlines(), report(unit).stdout
