"""Two shares on one card: each held to its own guarantee by the usage file the node writes, and
lent the card when the other is idle.

Two probes, each under the hook of a container of its own (its own limits and usage file), run
1 ms kernels on one fake card (FAKE_CUDA_SHARED_CARD: their kernels serialize, the card's NVML
samples count both). A stand-in for the node agent (testkit/share_agent.py) reads per-process
utilisation from the fake NVML every 100 ms, sums each share's processes and writes each share's
usage file with the lending policy's ceilings. Every figure is read off the fake card's clock
(what the card ran for each share, window by window), not off the test's wall clock, and each
measurement starts after the controller's warm-up: the first second a share runs unthrottled
and then settles (about 1.3 s from a cold start of both, on this machine).

Tolerances: ±5 points on a share's mean use over the measured stretch (the brief's bar; the
steady state observed is within 1 point), and bounds that leave a loaded 2-core machine room.
"""

from __future__ import annotations

import ctypes

import pytest

from core.policy import Priority
from testkit.native_kit import Kit
from testkit.share_agent import NVML_ERROR_INSUFFICIENT_SIZE, ShareAgent, fake_card_nvml
from testkit.share_run import Share, handover_s, run_shares

POINTS = 5.0


def mean(agent: ShareAgent, slot: str, started: int, from_s: float, to_s: float) -> float:
    return agent.mean_use(slot, started + int(from_s * 1e6), started + int(to_s * 1e6))


def test_two_busy_shares_each_get_their_guarantee(kit: Kit) -> None:
    a = Share("a", 30, ops=["launch:4000"])
    b = Share("b", 70, ops=["launch:4000"])
    agent, started = run_shares(kit, [a, b])
    assert mean(agent, "a", started, 2.2, 4.0) == pytest.approx(30, abs=POINTS)
    assert mean(agent, "b", started, 2.2, 4.0) == pytest.approx(70, abs=POINTS)


def test_a_share_of_two_processes_is_held_as_one(kit: Kit) -> None:
    # The node sums the share's processes; each process's hook steers by that sum, so their
    # rates add up to the share's guarantee together.
    a = Share("a", 30, ops=["launch:4000"], processes=2)
    b = Share("b", 70, ops=["launch:4000"])
    agent, started = run_shares(kit, [a, b])
    got_a, got_b = mean(agent, "a", started, 2.2, 4.0), mean(agent, "b", started, 2.2, 4.0)
    print(f"two-process share: {got_a:.1f} %, the other {got_b:.1f} %")
    assert got_a == pytest.approx(30, abs=POINTS)
    assert got_b == pytest.approx(70, abs=POINTS)


def test_without_usage_files_the_card_wide_controller_starves_the_smaller_share(kit: Kit) -> None:
    # Today's behaviour, kept when the node writes no usage file: each hook drives the card's
    # utilisation (both shares' sum) to its own target, so A is pushed towards its floor and the
    # card is left partly idle. Observed: A 3 %, B 62 % over the same stretch.
    a = Share("a", 30, ops=["launch:4000"])
    b = Share("b", 70, ops=["launch:4000"])
    agent, started = run_shares(kit, [a, b], usage=False)
    got_a = mean(agent, "a", started, 2.2, 4.0)
    got_b = mean(agent, "b", started, 2.2, 4.0)
    assert got_a < 15, got_a
    assert got_a + got_b < 90, (got_a, got_b)


def test_a_lone_share_allowed_to_burst_gets_the_idle_card(kit: Kit) -> None:
    a = Share("a", 30, ops=["launch:3000"])
    agent, started = run_shares(kit, [a, Share("b", 70, ops=["sleep:10"])])
    assert mean(agent, "a", started, 1.0, 3.0) >= 90


def test_a_lone_share_that_may_not_burst_keeps_its_guarantee(kit: Kit) -> None:
    a = Share("a", 30, may_burst=False, ops=["launch:3000"])
    agent, started = run_shares(kit, [a])
    assert mean(agent, "a", started, 1.5, 3.0) == pytest.approx(30, abs=POINTS)


def test_a_loan_ends_when_the_usage_file_goes_stale(kit: Kit) -> None:
    # The node agent stops writing while the lone share is bursting: 2 s after the last stamp
    # the file is stale and the hook is back to the card's samples and its compute_percent.
    a = Share("a", 30, ops=["launch:5500"])
    agent, started = run_shares(kit, [a], usage_until_s=1.8)
    assert mean(agent, "a", started, 1.0, 1.8) >= 90
    after = mean(agent, "a", started, 4.6, 5.4)
    print(f"stale usage file: A at {after:.1f} % once back on the card's samples")
    assert after == pytest.approx(30, abs=POINTS)


def test_the_owner_coming_back_gets_its_guarantee_within_a_second(kit: Kit) -> None:
    a = Share("a", 30, ops=["launch:5000"])
    b = Share("b", 70, ops=["launch:3000"], start_after_s=2.0)
    agent, started = run_shares(kit, [a, b])
    assert mean(agent, "a", started, 1.0, 2.0) >= 90  # A was bursting
    took = handover_s(
        agent, borrower="a", owner="b", target=30, points=POINTS, until_us=started + 4_800_000
    )
    print(f"handover: A back within {POINTS:.0f} points of 30 after {took:.2f} s")
    assert took <= 1.0, [(round(w.used["a"]), round(w.used["b"])) for w in agent.windows]


def test_a_high_priority_share_is_not_held_up_by_a_bursting_low_one(kit: Kit) -> None:
    # High: guarantee 50, a paced workload of 40 % (a 1 ms kernel every 2.5 ms, each waited
    # for). Low: guarantee 20, bursting into the idle card before high starts. Bound: at the
    # 99th percentile a high kernel takes at most what the fake card lets a process queue
    # ahead of it (20 ms, FIFO) plus its own 1 ms and 9 ms of slack for a loaded machine
    # (observed 18-22 ms), and high gets through at least 85 % of the kernels it paced (its
    # 40 % is below its guarantee, so its hook never holds it back; 1174-1200 of 1200 seen on
    # a quiet machine, 1068 on a loaded one, where each wait behind low's queue and the host's
    # own delays cost the pacer kernels it does not catch up; a hook that held high at 30 %
    # would give about 900).
    high = Share("a", 50, Priority.HIGH, ops=["pace:3000:2500:1000"], start_after_s=2.0)
    low = Share("b", 20, Priority.LOW, ops=["launch:5000"])
    agent, started = run_shares(kit, [high, low])
    assert high.result is not None
    rc, kernels, p50_us, p99_us, worst_us = high.result.one("pace")
    print(f"high priority: p50 {p50_us} us, p99 {p99_us} us, worst {worst_us} us, {kernels}")
    assert rc == 0
    assert kernels >= 0.85 * 3000 / 2.5
    assert p99_us <= 30_000
    bursting = mean(agent, "b", started, 1.0, 2.0)
    assert bursting >= 90, bursting  # low was bursting before high came


def test_the_fake_nvml_reports_each_process_on_the_shared_card(kit: Kit) -> None:
    # What the stand-in agent relies on: both processes' kernels in the card's samples, each
    # process's own in its per-process samples, NOT_FOUND once nothing newer is left, and NVML's
    # sizing protocol (a NULL buffer is answered with the count needed).
    nvml = fake_card_nvml(kit)
    a = Share("a", 100, ops=["launch:600"])
    b = Share("b", 100, ops=["launch:600"])
    _, started = run_shares(kit, [a, b], usage=False)
    ours = {a.pid, b.pid}
    # Windows that closed after the start still hold the tail of the previous test's processes.
    samples = [x for x in nvml.process_samples(started) if x[0] in ours]
    assert {pid for pid, _, _ in samples} == ours, samples
    busiest = max(sum(sm for p, s, sm in samples if s == stamp) for _, stamp, _ in samples)
    assert busiest >= 90  # the two processes' kernels filled the one card between them
    newest = max(stamp for _, stamp, _ in samples)
    assert nvml.process_samples(newest) == []
    count = ctypes.c_uint(0)
    rc = nvml.lib.nvmlDeviceGetProcessUtilization(
        nvml.handle, None, ctypes.byref(count), ctypes.c_ulonglong(started)
    )
    assert rc == NVML_ERROR_INSUFFICIENT_SIZE
    assert count.value == len(nvml.process_samples(started))
