"""The hook on a real NVIDIA GPU with PyTorch (marker ``gpu``; skipped without a GPU and torch).

    .venv/bin/pytest -m gpu tests/test_native_gpu.py -s

Builds the release-flag hook pointed at a temporary limits directory, writes a limits file for
card 0 with the contract's writer, and runs PyTorch under LD_PRELOAD: a 4 GiB share must read as
4 GiB from torch.cuda.mem_get_info and run out of memory near 4 GiB, whichever way PyTorch takes
device memory (its caching allocator over cudaMalloc, the cudaMallocAsync backend over
stream-ordered pools, expandable segments over the VMM calls cuMemCreate/cuMemMap) and with the
driver preloaded ahead of the hook; a CUDA graph whose capture allocates more than the share
(graph memory nodes, under the cudaMallocAsync backend) must fail to replay; a 30 % compute
share must run a matmul loop, and a CUDA graph replay of it, at about 30 % of the unthrottled
speed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import pytest

from testkit.native_kit import Kit, release_kit, torch_gpu_uuid

GIB = 1 << 30
pytestmark = pytest.mark.gpu


UUID = torch_gpu_uuid()
if UUID is None:
    pytest.skip("needs an NVIDIA GPU, its driver and torch", allow_module_level=True)


@pytest.fixture
def kit() -> Iterator[Kit]:
    k = release_kit()
    k.reset()
    yield k
    k.reset()


def run_torch(
    kit: Kit,
    script: str,
    timeout: float = 300,
    extra: Mapping[str, str] | None = None,
    check_exit: bool = True,
) -> dict[str, Any]:
    # The real driver, not the fakes: no LD_LIBRARY_PATH, only the hook preloaded.
    env = {k: v for k, v in kit.env(hooked=True).items() if k != "LD_LIBRARY_PATH"}
    env.update(extra or {})
    proc = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0 or not check_exit, proc.stderr
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


MEMORY = """
import json, torch
free, total = torch.cuda.mem_get_info()
blocks = []
try:
    while True:
        blocks.append(torch.empty(64 << 20, dtype=torch.uint8, device="cuda"))
except torch.cuda.OutOfMemoryError:
    pass
print(json.dumps({"total": total, "free": free, "allocated": len(blocks) * (64 << 20)}))
"""


# How PyTorch takes device memory: each reaches the driver through other entry points.
ALLOCATORS = [
    pytest.param({}, id="caching-allocator-cuMemAlloc"),
    pytest.param({"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}, id="cudaMallocAsync"),
    pytest.param({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, id="expandable-vmm"),
]


@pytest.mark.parametrize("conf", ALLOCATORS)
def test_pytorch_sees_the_share_and_runs_out_of_memory_near_it(
    kit: Kit, conf: dict[str, str]
) -> None:
    assert UUID is not None
    kit.write_limits(4 * GIB, 100, devices=(UUID,))
    out = run_torch(kit, MEMORY, extra=conf)
    assert out["total"] == 4 * GIB
    assert 3 * GIB <= out["allocated"] <= 4 * GIB


def test_the_driver_preloaded_ahead_of_the_hook_is_still_held(kit: Kit) -> None:
    # As a pod may set it: LD_PRELOAD names the driver, and the hook comes after it.
    assert UUID is not None
    kit.write_limits(4 * GIB, 100, devices=(UUID,))
    out = run_torch(kit, MEMORY, extra={"LD_PRELOAD": f"libcuda.so.1 {kit.hook}"})
    assert out["total"] == 4 * GIB
    assert out["allocated"] <= 4 * GIB


GRAPH = """
import json, os, torch
x = torch.ones(1024, device="cuda")
side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    y = x * 2  # warm-up outside the capture, as torch.cuda.graph wants
torch.cuda.current_stream().wait_stream(side)
g = torch.cuda.CUDAGraph()
replayed, error = 0, ""
try:
    with torch.cuda.graph(g):
        big = torch.empty(int(os.environ["GRAPH_BYTES"]), dtype=torch.uint8, device="cuda")
        big.fill_(1)
    g.replay()
    torch.cuda.synchronize()
    replayed = 1
except RuntimeError as e:  # out of memory at instantiation or launch
    error = str(e)[:400]
print(json.dumps({"replayed": replayed, "error": error}))
"""


@pytest.mark.parametrize(
    ("gib", "hooked", "replayed"),
    [
        pytest.param(6, True, False, id="beyond-the-share"),
        pytest.param(1, True, True, id="within-the-share"),
        pytest.param(6, False, True, id="beyond-the-share-without-the-hook"),
    ],
)
def test_graph_memory_nodes_beyond_the_share_do_not_replay(
    kit: Kit, gib: int, hooked: bool, replayed: bool
) -> None:
    # Under the cudaMallocAsync backend an allocation inside torch.cuda.graph is captured as a
    # graph memory node: nothing is allocated until the graph is launched. Without the hook the
    # same script must replay, so a refusal is the hook's and not the script's.
    assert UUID is not None
    kit.write_limits(4 * GIB, 100, devices=(UUID,))
    extra = {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync", "GRAPH_BYTES": str(gib * GIB)}
    if not hooked:
        extra["LD_PRELOAD"] = ""
    # A refused graph's program aborts at exit (test below); what it saw before that is checked.
    out = run_torch(kit, GRAPH, extra=extra, check_exit=replayed)
    assert bool(out["replayed"]) == replayed, out["error"]
    if not replayed:
        assert "out of memory" in str(out["error"]).lower(), out["error"]


@pytest.mark.xfail(
    strict=False,
    reason="open: after the hook refuses a graph's instantiation (out of memory), PyTorch's "
    "cudaMallocAsync backend frees the never-launched captured allocation outside the graph at "
    "exit; the driver answers cudaErrorInvalidValue and PyTorch aborts (seen on an H200, "
    "PyTorch 2.11). Whether a graph the driver itself cannot fit ends the same way was not "
    "checked.",
)
def test_a_program_whose_graph_is_refused_exits_cleanly(kit: Kit) -> None:
    assert UUID is not None
    kit.write_limits(4 * GIB, 100, devices=(UUID,))
    extra = {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync", "GRAPH_BYTES": str(6 * GIB)}
    out = run_torch(kit, GRAPH, extra=extra)
    assert not out["replayed"]


SPEED = """
import json, time, torch
a = torch.randn(4096, 4096, device="cuda")
b = torch.randn(4096, 4096, device="cuda")
def loop(seconds, step):
    torch.cuda.synchronize()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        step()
        n += 1
        if n % 8 == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return n / (time.perf_counter() - t0)
loop(1.0, lambda: a @ b)  # warm-up, and the throttle settles
eager = loop(6.0, lambda: a @ b)
static = torch.empty(4096, 4096, device="cuda")
s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    for _ in range(3):
        static.copy_(a @ b)
torch.cuda.current_stream().wait_stream(s)
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    for _ in range(8):
        static.copy_(a @ b)
loop(1.0, g.replay)
graph = loop(6.0, g.replay)
print(json.dumps({"eager": eager, "graph": graph}))
"""


def test_a_30_percent_share_runs_matmuls_and_graph_replays_at_about_30_percent(kit: Kit) -> None:
    assert UUID is not None
    kit.write_limits(16 * GIB, 100, devices=(UUID,))
    full = run_torch(kit, SPEED)
    kit.write_limits(16 * GIB, 30, devices=(UUID,))
    share = run_torch(kit, SPEED)
    print(f"\nunthrottled {full}, at 30 %: {share}")
    assert share["eager"] / full["eager"] == pytest.approx(0.30, abs=0.10)
    assert share["graph"] / full["graph"] == pytest.approx(0.30, abs=0.10)
