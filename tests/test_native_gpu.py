"""The hook on a real NVIDIA GPU with PyTorch (marker ``gpu``; skipped without a GPU and torch).

    .venv/bin/pytest -m gpu tests/test_native_gpu.py -s

Builds the release-flag hook pointed at a temporary limits directory, writes a limits file for
card 0 with the contract's writer, and runs PyTorch under LD_PRELOAD: a 4 GiB share must read as
4 GiB from torch.cuda.mem_get_info and run out of memory near 4 GiB; a 30 % compute share must
run a matmul loop, and a CUDA graph replay of it, at about 30 % of the unthrottled speed.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.fakes.native_kit import Kit, release_kit

GIB = 1 << 30
pytestmark = pytest.mark.gpu


def _gpu_uuid() -> str | None:
    if importlib.util.find_spec("torch") is None:
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
        uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(0))
    except Exception:
        return None
    return uuid.decode() if isinstance(uuid, bytes) else str(uuid)


UUID = _gpu_uuid()
if UUID is None:
    pytest.skip("needs an NVIDIA GPU, its driver and torch", allow_module_level=True)


@pytest.fixture
def kit() -> Iterator[Kit]:
    k = release_kit()
    k.reset()
    yield k
    k.reset()


def run_torch(kit: Kit, script: str, timeout: float = 300) -> dict[str, float]:
    # The real driver, not the fakes: no LD_LIBRARY_PATH, only the hook preloaded.
    env = {k: v for k, v in kit.env(hooked=True).items() if k != "LD_LIBRARY_PATH"}
    proc = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    result: dict[str, float] = json.loads(proc.stdout.strip().splitlines()[-1])
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


def test_pytorch_sees_the_share_and_runs_out_of_memory_near_it(kit: Kit) -> None:
    assert UUID is not None
    kit.write_limits(4 * GIB, 100, devices=(UUID,))
    out = run_torch(kit, MEMORY)
    assert out["total"] == 4 * GIB
    assert 3 * GIB <= out["allocated"] <= 4 * GIB


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
