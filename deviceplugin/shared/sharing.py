"""The node's half of compute sharing: what each share used of its card, and what it may use now.

The hook inside a container holds it to its compute share with NVML's utilisation of the
*card*, the only figure a container can read: its per-process figures are keyed by host PIDs,
which a container does not know. With two busy shares on a card each hook then drives the sum
of both towards its own target, and the smaller share is held far below its guarantee. The node
knows which host PID is whose (the guard names each process's container), so after every guard
scan this module writes each throttled share's ``usage`` file (core/contract.py) into the
share's limits directory: its own SM use since the previous scan, and its ceiling for the next,
from the lending policy (deviceplugin/shared/lending.py) and the share's compute policy
(core/policy.py). The hook reads the file every 50 ms and controls the share's own use; when
the file goes stale (the agent stopped), it falls back to the card's figure by itself.

A share of several cards gets one file: its highest use of any of its cards, and its lowest
ceiling (the file has one figure of each; the share's cards are held alike).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from core.contract import USAGE_MAX_WINDOW_US, LimitsError, ShareUsage
from core.policy import HARD_CAP, SharePolicy
from core.units import CORE_PER_CARD
from deviceplugin.shared.guardtypes import Owner, Usage
from deviceplugin.shared.lending import ShareState, ceilings, wants_more

log = logging.getLogger(__name__)

PolicyOf = Callable[[Owner], SharePolicy]


class ShareMeter:
    """Called once per guard scan with what the scan read."""

    def __init__(
        self,
        policy_of: PolicyOf | None = None,
        clock_us: Callable[[], int] = lambda: time.time_ns() // 1000,
    ) -> None:
        self._policy_of = policy_of or (lambda owner: HARD_CAP)
        self._clock_us = clock_us
        self._last_us: int | None = None
        self._ceilings: dict[str, int] = {}  # grant -> the ceiling written last
        self.written = 0  # usage files written, for tests and metrics

    def update(
        self, usage: Sequence[Usage], busy: Mapping[int, Mapping[int, float]]
    ) -> dict[str, int]:
        """Write the usage file of every throttled share seen on a sampled card; each one's
        ceiling, by grant (its limits directory)."""
        now = self._clock_us()
        last, self._last_us = self._last_us, now
        if last is None or now <= last:
            return {}  # the first scan's samples cover an unknown time: nothing to say yet
        window = min(now - last, USAGE_MAX_WINDOW_US)
        used: dict[str, float] = {}
        ceiling: dict[str, int] = {}
        owners: dict[str, Owner] = {}
        per_card: dict[int, dict[str, float]] = {}
        for entry in usage:
            owner = entry.owner
            sampled = busy.get(entry.card.index)
            if not owner.grant or sampled is None:
                continue
            if owner.limits.compute_percent >= CORE_PER_CARD:
                continue  # never throttled: nothing to tell its hook
            share = min(100.0, sum(sampled.get(p.pid, 0.0) for p in entry.processes))
            card = per_card.setdefault(entry.card.index, {})
            card[owner.grant] = min(100.0, card.get(owner.grant, 0.0) + share)
            owners.setdefault(owner.grant, owner)
        for shares in per_card.values():
            states = [self._state(owners[grant], grant, use) for grant, use in shares.items()]
            for grant, given in ceilings(states).items():
                assert isinstance(grant, str)
                ceiling[grant] = min(ceiling.get(grant, CORE_PER_CARD), given)
                used[grant] = max(used.get(grant, 0.0), shares[grant])
        for grant, given in ceiling.items():
            try:
                ShareUsage(now, window, round(used[grant]), given).write_atomic(Path(grant))
            except (OSError, LimitsError) as exc:
                log.warning("usage file not written", extra={"grant": grant, "error": str(exc)})
                continue
            self.written += 1
        self._ceilings = dict(ceiling)
        return ceiling

    def _state(self, owner: Owner, grant: str, used: float) -> ShareState:
        guarantee = owner.limits.compute_percent
        policy = self._policy_of(owner)
        return ShareState(
            grant,
            guarantee,
            policy.priority,
            policy.may_burst(guarantee),
            used,
            wants_more(used, self._ceilings.get(grant, guarantee), guarantee),
            cap=policy.ceiling_for(guarantee),
        )


__all__ = ["PolicyOf", "ShareMeter"]
