"""The share holds against programs that try to get around the hook: one test per route, each
run against the fake driver (a 16 GiB card) with a small limit, and each also run without the
hook where that shows the program really can take more than its share there."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from core.contract import LIMITS_FILE
from testkit.native_kit import (
    CUDA_ERROR_OUT_OF_MEMORY,
    MIB,
    Kit,
    Probe,
    asan_runtime,
    release_kit,
)

LIMIT = 128 * MIB
CHUNK = 32 * MIB
CARD = 16384 * MIB
MODES = ["proc", "proc-ptds", "proc-v1", "dlsym", "direct"]


@pytest.fixture
def kit(kit: Kit) -> Kit:
    """The shared sanitizer kit (reset around each test) with a share of LIMIT."""
    kit.write_limits(LIMIT)
    return kit


@pytest.fixture
def plain() -> Iterator[Kit]:
    """The release build: the sanitizer runtime refuses RTLD_DEEPBIND and other namespaces."""
    k = release_kit()
    k.reset()
    k.write_limits(LIMIT)
    yield k
    k.reset()


def got(out: Probe, op: str) -> int:
    (total,) = out.one(op)
    return total


# ---- the order of preloaded libraries ----------------------------------------------------------


def driver_first(kit: Kit, hooked: bool) -> dict[str, str]:
    """LD_PRELOAD naming the driver, as a pod may set it, ahead of the hook (which the container
    preloads through /etc/ld.so.preload, after every LD_PRELOAD library)."""
    libs = [asan_runtime(), str(kit.build / "fake" / "libcuda.so.1")]
    return {"LD_PRELOAD": " ".join([*libs, str(kit.hook)] if hooked else libs)}


@pytest.mark.parametrize("mode", MODES)
def test_a_driver_preloaded_ahead_of_the_hook_is_still_held(kit: Kit, mode: str) -> None:
    out = kit.probe("init", f"fill:{CHUNK}", "info", mode=mode, env=driver_first(kit, True))
    assert out.one("fill") == [LIMIT // CHUNK, CUDA_ERROR_OUT_OF_MEMORY]
    assert out.one("info") == [0, 0, LIMIT]


def test_without_the_hook_that_order_gets_the_whole_card(kit: Kit) -> None:
    out = kit.probe("init", f"fill:{CHUNK}", mode="direct", env=driver_first(kit, False))
    assert out.one("fill") == [CARD // CHUNK, CUDA_ERROR_OUT_OF_MEMORY]


# ---- libraries that bind on their own --------------------------------------------------------


@pytest.mark.parametrize(
    ("op", "fixture"),
    [
        pytest.param("deepbind", "plain", id="dlopen-RTLD_DEEPBIND"),
        pytest.param("dlmopen", "plain", id="dlmopen-LM_ID_NEWLM"),
        pytest.param("next", "kit", id="dlsym-RTLD_NEXT-after-the-hook"),
    ],
)
@pytest.mark.parametrize("hooked", [True, False], ids=["hooked", "unhooked"])
def test_a_library_that_binds_the_driver_itself_is_held(
    request: pytest.FixtureRequest, op: str, fixture: str, hooked: bool
) -> None:
    k: Kit = request.getfixturevalue(fixture)
    out = k.probe(f"{op}:{CHUNK}", mode="dlsym", hooked=hooked)
    assert got(out, op) == (LIMIT if hooked else CARD)


# ---- no valid limits inside a fracgpu container ------------------------------------------------


def in_new_mount_namespace(kit: Kit, ops: Sequence[str], mount: str) -> Probe:
    """Run the probe as an unprivileged user can: a user + mount namespace of its own, with a
    tmpfs mounted over the given directory."""
    proc = subprocess.run(
        ["unshare", "-Urm", "sh", "-c", f'mount -t tmpfs none {mount} && exec "$@"', "sh",
         *kit.command(ops)],
        env=kit.env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )  # fmt: skip
    result = Probe(proc.returncode, proc.stdout, proc.stderr)
    result.check_clean()
    return result


def dangling(kit: Kit) -> None:
    path = kit.limits_dir / LIMITS_FILE
    path.unlink()
    path.symlink_to(kit.root / "nowhere")


def installed_only(kit: Kit) -> None:
    shutil.rmtree(kit.limits_dir)
    shutil.rmtree(kit.shared_dir)


FAIL_CLOSED = [
    pytest.param(lambda k: (k.limits_dir / LIMITS_FILE).unlink(), "missing", id="missing-file"),
    pytest.param(dangling, "missing", id="dangling-symlink"),
    pytest.param(installed_only, "missing", id="no-directories-hook-at-installed-path"),
]


@pytest.mark.parametrize(("spoil", "word"), FAIL_CLOSED)
def test_a_container_without_valid_limits_gets_no_device_memory(
    kit: Kit, spoil: object, word: str
) -> None:
    assert callable(spoil)
    spoil(kit)
    installed = kit.root / "installed" / "libfracgpu.so"
    installed.parent.mkdir(exist_ok=True)
    shutil.copy(kit.hook, installed)
    env = {"LD_PRELOAD": f"{asan_runtime()} {installed}"}
    out = kit.probe("init", "alloc:1", f"vmm:{2 * MIB}", "info", env=env)
    assert out.rcs("alloc") == [CUDA_ERROR_OUT_OF_MEMORY]
    assert out.rcs("vmm") == [CUDA_ERROR_OUT_OF_MEMORY]
    assert out.one("info") == [0, 0, 0]
    (message,) = out.hook_messages
    assert word in message


def test_a_tmpfs_over_the_limits_directory_gets_no_device_memory(kit: Kit) -> None:
    out = in_new_mount_namespace(kit, ["init", "alloc:1", "info"], str(kit.limits_dir))
    assert out.rcs("alloc") == [CUDA_ERROR_OUT_OF_MEMORY]
    assert out.one("info") == [0, 0, 0]


# ---- the legacy v1 allocators ---------------------------------------------------------------

# (op, bytes it takes): rows padded to 512 bytes, arrays of FLOAT texels.
LEGACY = [
    pytest.param("pitch1:1000:1024", 1024 * 1024, id="cuMemAllocPitch"),
    pytest.param("array1:1024:1024", 4 * MIB, id="cuArrayCreate"),
    pytest.param("array3d1:256:256:16", 4 * MIB, id="cuArray3DCreate"),
]


@pytest.mark.parametrize("mode", ["proc", "proc-v1", "dlsym", "direct"])
@pytest.mark.parametrize(("op", "charged"), LEGACY)
def test_the_legacy_allocators_are_counted(kit: Kit, mode: str, op: str, charged: int) -> None:
    name = op.split(":", maxsplit=1)[0]
    out = kit.probe("init", op, "info", "free", "info", mode=mode)
    assert out.rcs(name) == [0]
    assert [v[1] for v in out.values("info")] == [LIMIT - charged, LIMIT]


@pytest.mark.parametrize("hooked", [True, False], ids=["hooked", "unhooked"])
@pytest.mark.parametrize(("op", "charged"), LEGACY)
def test_the_legacy_allocators_are_refused_beyond_the_limit(
    kit: Kit, op: str, charged: int, hooked: bool
) -> None:
    kit.write_limits(charged - 1)
    out = kit.probe("init", op, mode="proc-v1", hooked=hooked)
    assert out.rcs(op.split(":", maxsplit=1)[0]) == [CUDA_ERROR_OUT_OF_MEMORY if hooked else 0]


# ---- virtual memory management ------------------------------------------------------------------


@pytest.mark.parametrize("hooked", [True, False], ids=["hooked", "unhooked"])
def test_released_but_still_mapped_memory_stays_charged(kit: Kit, hooked: bool) -> None:
    # cuMemRelease of a mapped handle frees nothing: the memory lives until it is unmapped.
    out = kit.probe("init", f"vmmleak:{CHUNK}:10", "info", hooked=hooked)
    assert got(out, "vmmleak") == (LIMIT // CHUNK if hooked else 10)


def test_memory_released_and_unmapped_is_returned(kit: Kit) -> None:
    out = kit.probe("init", f"vmmcycle:{CHUNK}:10", "info", f"alloc:{LIMIT}")
    assert got(out, "vmmcycle") == 10
    assert out.one("info") == [0, LIMIT, LIMIT]
    assert out.rcs("alloc") == [0]


# ---- the accounting region under attack -------------------------------------------------------


def test_a_raw_clone_child_neither_frees_nor_zeroes_its_parents_share(kit: Kit) -> None:
    # The child runs no fork handler. It is accounted on its own (its share returns when it
    # exits, as a forked child's does); its exit must not zero the parent's slot, and its free
    # of the parent's allocation must not return the parent's charge.
    out = kit.probe(
        "init", f"alloc:{64 * MIB}", f"rawclone-alloc:{48 * MIB}", f"rawclone-alloc:{48 * MIB}",
        "rawclone-free", f"alloc:{65 * MIB}", "info",
    )  # fmt: skip
    assert out.rcs("child") == [0, 0, 0]
    assert out.rcs("alloc") == [0, CUDA_ERROR_OUT_OF_MEMORY]
    assert out.one("info")[1] == LIMIT - 64 * MIB


def test_an_unreaped_zombie_gives_its_share_back(kit: Kit) -> None:
    out = kit.probe("init", f"zombie-alloc:{LIMIT}", f"alloc:{LIMIT}")
    assert out.rcs("child") == [0]
    assert out.rcs("alloc") == [0]


class Holder:
    """A hooked process that takes the whole share and waits for a file before going on."""

    def __init__(self, kit: Kit, go: str, *after: str) -> None:
        self.proc = subprocess.Popen(
            kit.command(["init", f"alloc:{LIMIT}", "sleep:0", f"await:{go}", *after]),
            env=kit.env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        self.seen = ""
        for line in self.proc.stdout:
            self.seen += line
            if line.startswith("sleep"):
                return
        raise AssertionError(f"holder ended early: {self.seen}")

    def finish(self) -> Probe:
        out, err = self.proc.communicate(timeout=60)
        result = Probe(self.proc.returncode, self.seen + out, err)
        result.check_clean()
        return result


def test_removing_the_accounting_file_does_not_open_a_second_share(
    kit: Kit, tmp_path: Path
) -> None:
    go = tmp_path / "go-rm"
    holder = Holder(kit, str(go), "info")
    try:
        kit.region.unlink()
        out = kit.probe("init", "alloc:1", "info")
        assert out.rcs("alloc") == [CUDA_ERROR_OUT_OF_MEMORY]
        assert out.one("info")[1] == 0
    finally:
        go.touch()
        holder.finish()


def test_truncating_the_accounting_file_neither_crashes_nor_frees_the_share(
    kit: Kit, tmp_path: Path
) -> None:
    go = tmp_path / "go-truncate"
    holder = Holder(kit, str(go), "alloc:1", "info")
    try:
        with kit.region.open("r+b") as f:
            f.truncate(0)
        # The holder's memory is unknown until it has refilled its slot: nothing is granted.
        out = kit.probe("init", "alloc:1")
        assert out.rcs("alloc") == [CUDA_ERROR_OUT_OF_MEMORY]
    finally:
        go.touch()
        done = holder.finish()  # exits 0: no SIGBUS
    assert done.rcs("alloc") == [0, CUDA_ERROR_OUT_OF_MEMORY]
    assert done.one("info")[1] == 0
    assert kit.probe("init", f"alloc:{LIMIT}").rcs("alloc") == [0]  # and it all comes back


def test_a_truncation_no_one_else_noticed_does_not_kill_the_holder(
    kit: Kit, tmp_path: Path
) -> None:
    go = tmp_path / "go-alone"
    holder = Holder(kit, str(go), "alloc:1", "free", f"alloc:{LIMIT}", "info")
    with kit.region.open("r+b") as f:
        f.truncate(0)
    go.touch()
    done = holder.finish()
    assert done.rcs("alloc") == [0, CUDA_ERROR_OUT_OF_MEMORY, 0]
    assert done.rcs("free") == [0]
    assert done.one("info")[1] == 0


@pytest.mark.parametrize("inner", ["holder", "newcomer"])
def test_a_nested_pid_namespace_does_not_reap_live_slots(
    kit: Kit, tmp_path: Path, inner: str
) -> None:
    go = tmp_path / "go-pidns"
    wrap = ["unshare", "-Urpf", "--mount-proc"]
    # LeakSanitizer cannot work inside a new user namespace; the address checks still run.
    env = kit.env(extra={"ASAN_OPTIONS": "detect_leaks=0"})
    holder_cmd = kit.command(["init", f"alloc:{LIMIT}", "sleep:0", f"await:{go}"])
    holder = subprocess.Popen(
        (wrap if inner == "holder" else []) + holder_cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        for line in holder.stdout:
            if line.startswith("sleep"):
                break
        cmd = (wrap if inner == "newcomer" else []) + kit.command(["init", "alloc:1"])
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60, check=False)
        out = Probe(proc.returncode, proc.stdout, proc.stderr)
        out.check_clean()
        assert out.rcs("alloc") == [CUDA_ERROR_OUT_OF_MEMORY]
    finally:
        go.touch()
        holder.communicate(timeout=60)


# ---- graph memory nodes, stream capture, module globals -------------------------------------

# (op, name, what it asks for beyond the share): each takes nothing when it is set up and all
# of it when launched (graphs) or loaded (modules).
DEFERRED = [
    pytest.param(f"graphalloc:{2 * LIMIT}", "graphalloc", id="cuGraphAddMemAllocNode"),
    pytest.param(f"capture:{LIMIT // 2}:4", "capture", id="cuMemAllocAsync-in-stream-capture"),
    pytest.param(f"module:{2 * LIMIT}", "module", id="cuModuleLoadData-globals"),
    pytest.param(f"modulefile:{2 * LIMIT}", "modulefile", id="cuModuleLoad-globals"),
    pytest.param(f"fatbin:{2 * LIMIT}", "fatbin", id="cuModuleLoadFatBinary-globals"),
    pytest.param(f"library:{2 * LIMIT}", "library", id="cuLibraryLoadData-globals"),
    pytest.param(f"libraryfile:{2 * LIMIT}", "libraryfile", id="cuLibraryLoadFromFile-globals"),
]


@pytest.mark.parametrize("hooked", [True, False], ids=["hooked", "unhooked"])
@pytest.mark.parametrize(("op", "name"), DEFERRED)
def test_memory_taken_at_launch_or_load_is_refused_beyond_the_share(
    kit: Kit, op: str, name: str, hooked: bool
) -> None:
    out = kit.probe("init", op, hooked=hooked)
    assert out.rcs(name) == [CUDA_ERROR_OUT_OF_MEMORY if hooked else 0]


@pytest.mark.parametrize(
    ("op", "name", "rc"),
    [
        pytest.param(f"graphalloc:{2 * LIMIT}", "graphalloc", 2, id="added-beyond"),
        pytest.param(f"graphalloc:{CHUNK}", "graphalloc", 0, id="added-within"),
        pytest.param(f"capture:{LIMIT // 2}:4", "capture", 2, id="captured-beyond"),
        pytest.param(f"capture:{CHUNK // 2}:2", "capture", 0, id="captured-within"),
    ],
)
def test_graph_memory_is_known_without_listing_the_graphs_nodes(
    kit: Kit, op: str, name: str, rc: int
) -> None:
    # A driver that cannot list nodes: the bytes added or captured into the graph are used.
    out = kit.probe("init", op, "info", env={"FAKE_CUDA_NO_GRAPH_NODES": "1"})
    assert out.rcs(name) == [rc]


@pytest.mark.parametrize("mode", ["proc", "direct"])
@pytest.mark.parametrize(
    ("op", "name"),
    [
        pytest.param(f"graphalloc:{2 * CHUNK}", "graphalloc", id="cuGraphAddMemAllocNode"),
        pytest.param(f"capture:{CHUNK}:2", "capture", id="cuMemAllocAsync-in-stream-capture"),
    ],
)
def test_graph_memory_is_counted_until_the_graph_pool_is_trimmed(
    kit: Kit, mode: str, op: str, name: str
) -> None:
    # The graph pool keeps what it reserved after the allocations are freed, as the driver's does.
    out = kit.probe("init", op, "info", "freeall", "info", "graphtrim", "info", mode=mode)
    assert out.rcs(name) == [0]
    assert [v[1] for v in out.values("info")] == [LIMIT - 2 * CHUNK, LIMIT - 2 * CHUNK, LIMIT]


@pytest.mark.parametrize("how", ["module", "modulefile", "fatbin", "library", "libraryfile"])
@pytest.mark.parametrize("mode", ["proc", "direct"])
def test_module_globals_are_counted_until_unloaded(kit: Kit, mode: str, how: str) -> None:
    out = kit.probe("init", f"{how}:{CHUNK}", "info", "free", "info", mode=mode)
    assert out.rcs(how) == [0]
    assert out.rcs("free") == [0]
    assert [v[1] for v in out.values("info")] == [LIMIT - CHUNK, LIMIT]


@pytest.mark.parametrize("mode", ["proc", "direct"])
def test_destroying_a_context_returns_its_linear_memory(kit: Kit, mode: str) -> None:
    # The driver frees what was allocated in the context; the charge must not outlive it.
    out = kit.probe("init", f"alloc:{LIMIT}", "ctxdestroy", f"alloc:{LIMIT}", "info", mode=mode)
    assert out.rcs("alloc") == [0, 0]
    assert out.rcs("ctxdestroy") == [0]
    assert out.one("info")[1] == 0


@pytest.mark.parametrize("hooked", [True, False], ids=["hooked", "unhooked"])
def test_a_pool_on_a_card_outside_the_grant_gets_nothing(kit: Kit, hooked: bool) -> None:
    # The context is on the granted card 0; the pool's memory would live on card 1.
    out = kit.probe("init", f"poolon:1:{MIB}", hooked=hooked, env={"FAKE_CUDA_DEVICES": "2"})
    assert out.rcs("poolon") == [CUDA_ERROR_OUT_OF_MEMORY if hooked else 0]


def test_a_pool_on_the_granted_card_is_charged_there(kit: Kit) -> None:
    out = kit.probe("init", f"poolon:0:{MIB}", "info", env={"FAKE_CUDA_DEVICES": "2"})
    assert out.rcs("poolon") == [0]
    assert out.one("info")[1] == LIMIT - CHUNK  # the pool grows by one 32 MiB chunk


@pytest.mark.parametrize("hooked", [True, False], ids=["hooked", "unhooked"])
def test_imported_vmm_memory_is_held_by_its_mappings(kit: Kit, hooked: bool) -> None:
    # Export, import as a second handle, release the first, map the second: the memory lives on
    # in the importer's mapping. The exporter keeps its charge and the mapping is charged too
    # (twice while both live: less for the container, never more).
    out = kit.probe("init", f"vmmimport:{CHUNK}:10", hooked=hooked)
    assert got(out, "vmmimport") == (LIMIT // (2 * CHUNK) if hooked else 10)
