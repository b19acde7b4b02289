"""Each device-plugin share's compute policy, read from its pod.

In device-plugin mode kubelet tells the plugin device IDs, never the pod, so the policy that
admission wrote on the pod (``fracgpu.io/compute-policy``, core/policy.py) is read from the API
server once the guard has named the container's pod (from its cgroup and kubelet's log link,
UID checked). The read is handed to the agent's API loop and never waited for: until it
answers, and whenever it cannot, the share is a hard cap (the safe side), and the lookup is
tried again after ``retry_s``. Answers are kept per pod UID (a pod's annotations of this kind
are fixed at admission) and dropped for pods not asked about for ``forget_s``.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from core.kube import PODS, Api, KubeError, KubeNotFound, call_json
from core.policy import HARD_CAP, POLICY_ANNOTATION, PolicyError, SharePolicy, decode_annotation
from deviceplugin.shared.apiloop import Spawn
from deviceplugin.shared.guardtypes import Owner

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Entry:
    policies: dict[str, SharePolicy] | None  # None: not known yet
    asked_at: float
    pending: concurrent.futures.Future[dict[str, SharePolicy]] | None = None
    retry_at: float = 0.0


class PodPolicies:
    def __init__(
        self,
        spawn: Spawn,
        *,
        retry_s: float = 10.0,
        forget_s: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._spawn = spawn
        self.retry_s = retry_s
        self.forget_s = forget_s
        self._clock = clock
        self._pods: dict[str, _Entry] = {}
        self._swept_at = clock()

    def __call__(self, owner: Owner) -> SharePolicy:
        now = self._clock()
        if now - self._swept_at > self.forget_s:
            self._swept_at = now
            self.forget_idle()
        entry = self._pods.get(owner.pod_uid)
        if entry is None:
            entry = self._pods[owner.pod_uid] = _Entry(None, now)
        entry.asked_at = now
        if entry.pending is not None and entry.pending.done():
            self._settle(owner, entry, now)
        if entry.policies is None and entry.pending is None and now >= entry.retry_at:
            entry.pending = self._spawn(lambda api: _read(api, owner))
        if entry.policies is None:
            return HARD_CAP
        return entry.policies.get(owner.container, HARD_CAP)

    def forget_idle(self) -> None:
        horizon = self._clock() - self.forget_s
        for uid in [u for u, e in self._pods.items() if e.asked_at < horizon]:
            del self._pods[uid]

    def _settle(self, owner: Owner, entry: _Entry, now: float) -> None:
        assert entry.pending is not None
        future, entry.pending = entry.pending, None
        try:
            entry.policies = future.result()
        except (KubeError, PolicyError, OSError, TimeoutError, RuntimeError) as exc:
            entry.retry_at = now + self.retry_s
            log.warning(
                "share's compute policy unreadable; held to its guarantee",
                extra={"pod": f"{owner.namespace}/{owner.pod}", "error": str(exc)},
            )


async def _read(api: Api, owner: Owner) -> dict[str, SharePolicy]:
    try:
        pod = await call_json(api, "GET", PODS.path(owner.namespace, owner.pod), timeout_s=10)
    except KubeNotFound:
        return {}  # gone: nothing to lend to
    meta = pod.get("metadata") or {}
    if meta.get("uid") != owner.pod_uid:
        return {}  # another pod under the name: not this container's
    raw = (meta.get("annotations") or {}).get(POLICY_ANNOTATION)
    return {} if raw is None else decode_annotation(raw)


__all__ = ["PodPolicies"]
