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

import pytest

from deviceplugin.shared.lending import Priority
from testkit.native_kit import Kit
from testkit.share_agent import ShareAgent
from testkit.share_run import Share, run_shares

POINTS = 5.0


def mean(agent: ShareAgent, slot: str, started: int, from_s: float, to_s: float) -> float:
    return agent.mean_use(slot, started + int(from_s * 1e6), started + int(to_s * 1e6))


def test_two_busy_shares_each_get_their_guarantee(kit: Kit) -> None:
    a = Share("a", 30, ops=["launch:4000"])
    b = Share("b", 70, ops=["launch:4000"])
    agent, started = run_shares(kit, [a, b])
    assert mean(agent, "a", started, 2.2, 4.0) == pytest.approx(30, abs=POINTS)
    assert mean(agent, "b", started, 2.2, 4.0) == pytest.approx(70, abs=POINTS)


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


def handover_s(agent: ShareAgent, until_us: int) -> float:
    """From the first window B ran in to the start of the first window from which A stays
    within POINTS of its 30 until until_us."""
    b_first = next(w for w in agent.windows if w.used["b"] >= 1)
    after = [w for w in agent.windows if w.from_us >= b_first.from_us and w.to_us <= until_us]
    settled = None
    for w in after:
        inside = abs(w.used["a"] - 30) <= POINTS
        settled = (settled or w) if inside else None
    assert settled is not None, [(round(w.used["a"]), round(w.used["b"])) for w in after]
    return (settled.from_us - b_first.from_us) / 1e6


def test_the_owner_coming_back_gets_its_guarantee_within_a_second(kit: Kit) -> None:
    a = Share("a", 30, ops=["launch:5000"])
    b = Share("b", 70, ops=["launch:3000"], start_after_s=2.0)
    agent, started = run_shares(kit, [a, b])
    assert mean(agent, "a", started, 1.0, 2.0) >= 90  # A was bursting
    took = handover_s(agent, started + 4_800_000)
    print(f"handover: A back within {POINTS:.0f} points of 30 after {took:.2f} s")
    assert took <= 1.0


def test_a_high_priority_share_is_not_held_up_by_a_bursting_low_one(kit: Kit) -> None:
    # High: guarantee 50, a paced workload of 40 % (a 1 ms kernel every 2.5 ms, each waited
    # for). Low: guarantee 20, bursting into the idle card before high starts. Bound: high's
    # kernels take at most what the fake card may queue ahead of a launch (20 ms) plus its own
    # 1 ms and 4 ms of slack at the 99th percentile, and high gets through at least 95 % of the
    # kernels it paced (its 40 % is below its guarantee, so the hook never holds it back).
    high = Share("a", 50, Priority.HIGH, ops=["pace:3000:2500:1000"], start_after_s=1.5)
    low = Share("b", 20, Priority.LOW, ops=["launch:4500"])
    agent, started = run_shares(kit, [high, low])
    assert high.result is not None
    rc, kernels, p50_us, p99_us, worst_us = high.result.one("pace")
    print(f"high priority: p50 {p50_us} us, p99 {p99_us} us, worst {worst_us} us, {kernels}")
    assert rc == 0
    assert kernels >= 0.95 * 3000 / 2.5
    assert p99_us <= 25_000
    assert mean(agent, "b", started, 0.8, 1.5) >= 90  # low was bursting before high came
