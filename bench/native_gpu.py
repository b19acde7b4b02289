"""What libfracgpu.so costs on a real NVIDIA card, against the same program without it, in one run.

    python -m bench.native_gpu [--launches N] [--allocs N] [--repeats R]

``bench.native`` measures the hook against the fake driver, whose calls cost nothing, so its
ratios overstate the hook's share. This one runs the real driver and PyTorch: a tiny kernel
launched N times (PyTorch's own per-launch cost included, as a user sees it), N pairs of
``cuMemAlloc_v2`` + ``cuMemFree_v2`` of 1 MiB through ``ctypes`` (the hook intercepts the
lookup, so these are the hooked calls), and the time a process takes from start to its first
kernel. Runs alternate, with and without the hook, and figures are medians. The hook runs with
a share far above what the benchmark uses and 100 % compute: the fast path. Without a GPU and
PyTorch it says so and exits 0, so ``make bench`` runs anywhere.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
from collections.abc import Sequence

from testkit.native_kit import Kit, build_kit

GIB = 1 << 30

CHILD = """
import ctypes, json, sys, time
t0 = time.perf_counter()
import torch
x = torch.zeros(1, device="cuda")
torch.cuda.synchronize()
start = time.perf_counter() - t0
launches, allocs = int(sys.argv[1]), int(sys.argv[2])
for _ in range(1000):
    x.add_(1)
torch.cuda.synchronize()
t = time.perf_counter()
for _ in range(launches):
    x.add_(1)
torch.cuda.synchronize()
launch = (time.perf_counter() - t) / launches
cuda = ctypes.CDLL("libcuda.so.1")
alloc_fn, free_fn = cuda.cuMemAlloc_v2, cuda.cuMemFree_v2
ptr = ctypes.c_uint64()
ref, size = ctypes.byref(ptr), ctypes.c_size_t(1 << 20)
t = time.perf_counter()
for _ in range(allocs):
    assert alloc_fn(ref, size) == 0
    assert free_fn(ptr) == 0
alloc = (time.perf_counter() - t) / allocs
print(json.dumps({"start": start, "launch": launch, "alloc": alloc}))
"""


def have_gpu() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    probe = "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"
    return subprocess.run([sys.executable, "-c", probe], check=False).returncode == 0


def one_run(kit: Kit, hooked: bool, launches: int, allocs: int) -> dict[str, float]:
    # The real driver: the kit's fakes stay off the library path.
    env = {k: v for k, v in kit.env(hooked).items() if k != "LD_LIBRARY_PATH"}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(launches), str(allocs)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"the benchmark's child failed (hooked={hooked}):\n{proc.stderr}")
    result: dict[str, float] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.native_gpu", description=__doc__)
    parser.add_argument("--launches", type=int, default=200_000)
    parser.add_argument("--allocs", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    if not have_gpu():
        print("bench.native_gpu: no NVIDIA GPU with PyTorch here; nothing measured")
        return 0

    import pynvml

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    uuid = pynvml.nvmlDeviceGetUUID(handle)
    uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
    name = pynvml.nvmlDeviceGetName(handle)
    pynvml.nvmlShutdown()

    kit = build_kit(sanitize=False)
    kit.reset()
    kit.write_limits(64 * GIB, 100, devices=(uuid,))
    runs: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    for i in range(args.repeats):  # alternating which goes first, so drift hits both sides
        for hooked in (False, True) if i % 2 == 0 else (True, False):
            runs[hooked].append(one_run(kit, hooked, args.launches, args.allocs))

    def median(hooked: bool, key: str) -> float:
        return statistics.median(r[key] for r in runs[hooked])

    print(f"libfracgpu.so on {name}, release build, real driver, median of {args.repeats}")
    print(f"{'measure':<36}{'no hook':>12}{'hook':>12}{'added':>12}{'ratio':>8}")
    rows = [
        ("tiny kernel via PyTorch (µs/launch)", "launch", 1e6),
        ("cuMemAlloc+cuMemFree 1 MiB (µs)", "alloc", 1e6),
        ("start to first kernel (ms)", "start", 1e3),
    ]
    for label, key, scale in rows:
        base, hook = median(False, key) * scale, median(True, key) * scale
        print(f"{label:<36}{base:>12.3f}{hook:>12.3f}{hook - base:>12.3f}{hook / base:>8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
