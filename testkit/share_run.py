"""Two shares on one fake card: their probes, each under its own container's hook, and the
stand-in node agent measuring them (testkit/share_agent.py). Used by tests/test_native_share.py
and bench/native.py, so both measure the same shapes the same way."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from core.contract import Limits
from core.policy import Priority
from testkit.native_kit import FAKE_UUID, MIB, Kit, Probe
from testkit.share_agent import AgentShare, ShareAgent, fake_card_nvml

KERNEL_US = 1000  # each fake kernel runs 1 ms of the card's clock


@dataclass
class Share:
    """A share of the card: a slot ("a" or "b": which test hook), its guarantee and request."""

    slot: str
    guarantee: int
    priority: Priority = Priority.LOW
    may_burst: bool = True
    ops: Sequence[str] = ()  # the probe's ops after init
    start_after_s: float = 0.0
    processes: int = 1  # probes of the share, each running ops
    result: Probe | None = field(default=None, repr=False)  # its first probe's
    pid: int = 0  # its first probe's, once started


def now_us() -> int:
    return time.time_ns() // 1000


def run_shares(
    kit: Kit,
    shares: Sequence[Share],
    usage: bool = True,
    usage_until_s: float | None = None,
) -> tuple[ShareAgent, int]:
    """Run the shares' probes on the kit's shared card (each started start_after_s after the
    first) with the stand-in agent measuring them; with usage, it also writes their usage files
    (until usage_until_s, if given: then it stops writing, as an agent that died). Returns the
    agent (what it measured) and the start time (µs, CLOCK_REALTIME)."""
    agent_shares = []
    for s in shares:
        kit.reset_share(s.slot)
        Limits((FAKE_UUID,), 1024 * MIB, s.guarantee).write_atomic(kit.share_limits_dir(s.slot))
        agent_shares.append(
            AgentShare(s.slot, kit.share_limits_dir(s.slot), s.guarantee, s.priority, s.may_burst)
        )
    hooks = {s.slot: kit.share_hook(s.slot) for s in shares}
    agent = ShareAgent(fake_card_nvml(kit), agent_shares, write=usage)
    started = now_us()
    if usage_until_s is not None:
        agent.write_until_us = started + int(usage_until_s * 1e6)
    agent.start()
    running: list[tuple[Share, subprocess.Popen[str]]] = []
    try:
        for s in sorted(shares, key=lambda s: s.start_after_s):
            delay = started / 1e6 + s.start_after_s - time.time()
            if delay > 0:
                time.sleep(delay)
            env = kit.env(
                hook=hooks[s.slot],
                extra={
                    "FAKE_CUDA_KERNEL_US": str(KERNEL_US),
                    "FAKE_CUDA_SHARED_CARD": str(kit.shared_card),
                },
            )
            for _ in range(s.processes):
                proc = subprocess.Popen(
                    kit.command(["init", *s.ops]),
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
                s.pid = s.pid or proc.pid
                next(a for a in agent_shares if a.name == s.slot).pids.add(proc.pid)
                running.append((s, proc))
        for s, proc in running:
            out, err = proc.communicate(timeout=60)
            result = Probe(proc.returncode, out, err)
            result.check_clean()
            s.result = s.result or result
    finally:
        for _, proc in running:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        agent.stop()
    assert all(s.result is not None for s in shares)
    return agent, started


def handover_s(
    agent: ShareAgent, *, borrower: str, owner: str, target: float, points: float, until_us: int
) -> float:
    """How long the borrower took to give the card back: from the first window the owner ran in
    to the first window W where the borrower is within points of target and stays so on
    average from W to until_us (a mean, so that one window disturbed by a loaded machine does
    not restart the count). Infinite when it never does."""
    first = next((w for w in agent.windows if w.used[owner] >= 1), None)
    if first is None:
        return float("inf")
    after = [w for w in agent.windows if w.from_us >= first.from_us and w.to_us <= until_us]
    for k, w in enumerate(after):
        rest = after[k:]
        span = sum(x.to_us - x.from_us for x in rest)
        mean = sum(x.used[borrower] * (x.to_us - x.from_us) for x in rest) / span
        if abs(w.used[borrower] - target) <= points and abs(mean - target) <= points:
            return (w.from_us - first.from_us) / 1e6
    return float("inf")
