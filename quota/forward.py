"""One writer per GPUQuota: replicas send their quota decisions to the controller's leader.

Why. Every decision is a compare-and-swap write of the GPUQuota status, batched per namespace
within a replica. Two replicas deciding pods of one namespace at once keep invalidating each
other's version: with two replicas and 16 creates in flight a third of the writes conflicted,
and each conflict costs a re-read and another write. Kubernetes' own ResourceQuota avoids this
inside one kube-apiserver by deciding a namespace in one place. Here that place is the replica
that holds the quota controller's Lease: it advertises its address on the Lease
(:data:`DECIDER_ANNOTATION`), and the other replicas send it what to decide (namespace, pod,
UID, demand: a few hundred bytes) on :data:`DECIDE_PATH`. Its batches then hold the pods of every
replica, and nothing conflicts but the controller's own recounts.

Safety does not depend on it. The leader decides with the same compare-and-swap writes, so a
replica that believes it is the leader when it no longer is, two replicas deciding at once, or
a forwarded decision repeated by its sender (same pod UID: never charged twice while pending) are
all as safe as before. When the leader cannot be reached (no address yet, connection refused,
no answer within half of ``quota.timeout_s``), the replica decides itself and stops forwarding
for a few seconds; a dry run is always checked where it arrives (it writes nothing).
"""

from __future__ import annotations

import logging
import ssl
import time
from collections.abc import Awaitable, Callable
from typing import TypedDict

import aiohttp
from aiohttp import web

from quota.decision import Decision
from quota.demand import Demand
from quota.metrics import QuotaMetrics
from quota.reserver import Reserver

log = logging.getLogger(__name__)

DECIDE_PATH = "/quota/decide"
DECIDER_ANNOTATION = "fracgpu.io/quota-decider"
# A decision request is a few hundred bytes; anything much larger is not one.
MAX_BODY_BYTES = 16 * 1024


class DemandWire(TypedDict):
    core: int
    memoryMiB: int
    models: list[str] | None
    excludedModels: list[str]
    unsizedCards: int


class DecideRequest(TypedDict):
    """What a replica sends the leader: the decision's inputs, already computed."""

    namespace: str
    uid: str
    pod: str
    demand: DemandWire


class DecideAnswer(TypedDict):
    allowed: bool
    message: str
    reason: str


def encode(namespace: str, uid: str, pod: str, demand: Demand) -> DecideRequest:
    return {
        "namespace": namespace,
        "uid": uid,
        "pod": pod,
        "demand": {
            "core": demand.core,
            "memoryMiB": demand.memory_mib,
            "models": sorted(demand.models) if demand.models is not None else None,
            "excludedModels": sorted(demand.excluded),
            "unsizedCards": demand.unsized_cards,
        },
    }


def decode(body: object) -> tuple[str, str, str, Demand]:
    """The request's fields; ValueError naming the first one that is missing or malformed."""
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object")
    fields: dict[str, str] = {}
    for name in ("namespace", "uid", "pod"):
        value = body.get(name)
        if not isinstance(value, str) or not value:
            raise ValueError(f"{name!r} must be a non-empty string")
        fields[name] = value
    wire = body.get("demand")
    if not isinstance(wire, dict):
        raise ValueError("'demand' must be an object")
    numbers: dict[str, int] = {}
    for name in ("core", "memoryMiB", "unsizedCards"):
        value = wire.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"'demand.{name}' must be a non-negative integer")
        numbers[name] = value
    models = wire.get("models")
    if models is not None and (
        not isinstance(models, list) or not all(isinstance(m, str) for m in models)
    ):
        raise ValueError("'demand.models' must be null or a list of strings")
    # Absent from a replica of an earlier version: it forwarded no exclusion.
    excluded = wire.get("excludedModels", [])
    if not isinstance(excluded, list) or not all(isinstance(m, str) for m in excluded):
        raise ValueError("'demand.excludedModels' must be a list of strings")
    demand = Demand(
        numbers["core"],
        numbers["memoryMiB"],
        frozenset(models) if models is not None else None,
        unsized_cards=numbers["unsizedCards"],
        excluded=frozenset(excluded),
    )
    return fields["namespace"], fields["uid"], fields["pod"], demand


def decide_endpoint(
    reserver: Reserver, metrics: QuotaMetrics
) -> Callable[[web.Request], Awaitable[web.Response]]:
    """The leader's side: decide a forwarded pod here, never forwarding it again."""

    async def handle(request: web.Request) -> web.Response:
        declared = request.content_length
        if declared is None or declared > MAX_BODY_BYTES:
            return web.json_response(
                {"error": f"a decision request is at most {MAX_BODY_BYTES} bytes, with a length"},
                status=413,
            )
        try:
            namespace, uid, pod, demand = decode(await request.json())
        except ValueError as exc:
            return web.json_response({"error": f"bad decision request: {exc}"}, status=400)
        decision = await reserver.decide(namespace, uid, pod, demand)
        metrics.decided_for_peers.inc()
        answer: DecideAnswer = {
            "allowed": decision.allowed,
            "message": decision.message,
            "reason": decision.reason,
        }
        return web.json_response(answer)

    return handle


class Forwarder:
    """A replica's side: send the decision to the leader; None means decide here.

    ``leader`` says where the leader is (None: unknown, expired, or this replica leads).
    ``ca_pem`` and ``server_name``: how to check the leader's serving certificate, which is
    every replica's (issued for the Service's name, reached here by pod address).
    """

    def __init__(
        self,
        leader: Callable[[], str | None],
        metrics: QuotaMetrics,
        *,
        timeout_s: float,
        ca_pem: Callable[[], bytes] | None = None,
        server_name: str | None = None,
        connect_timeout_s: float = 0.25,
        quiet_s: float = 5.0,
    ) -> None:
        self.leader = leader
        self.metrics = metrics
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.quiet_s = quiet_s
        self.ca_pem = ca_pem
        self.server_name = server_name
        self._session: aiohttp.ClientSession | None = None
        self._context: tuple[bytes, ssl.SSLContext] | None = None
        self._quiet_until = 0.0
        self._problem: str | None = None

    def _ssl(self) -> ssl.SSLContext | None:
        if self.ca_pem is None:
            return None
        pem = self.ca_pem()
        if not pem:  # certificates from elsewhere (cert-manager, files) without a CA bundle
            return None  # here: the system's trust store
        if self._context is None or self._context[0] != pem:  # the CA rotated
            context = ssl.create_default_context(cadata=pem.decode())
            self._context = (pem, context)
        return self._context[1]

    async def decide(self, namespace: str, uid: str, pod: str, demand: Demand) -> Decision | None:
        url = self.leader()
        if url is None or time.monotonic() < self._quiet_until:
            return None
        if self._session is None:
            self._session = aiohttp.ClientSession()
        timeout = aiohttp.ClientTimeout(total=self.timeout_s, sock_connect=self.connect_timeout_s)
        try:
            async with self._session.post(
                url.rstrip("/") + DECIDE_PATH,
                json=encode(namespace, uid, pod, demand),
                timeout=timeout,
                ssl=self._ssl() or True,
                server_hostname=self.server_name if url.startswith("https:") else None,
            ) as reply:
                if reply.status != 200:
                    raise ValueError(f"answered {reply.status}: {(await reply.text())[:200]}")
                answer = await reply.json()
            decision = Decision(
                bool(answer["allowed"]), str(answer["message"]), str(answer["reason"])
            )
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError, KeyError, TypeError) as exc:
            self._fallback(url, f"{type(exc).__name__}: {exc}")
            return None
        if self._problem is not None:
            log.info("quota decisions reach the leader again", extra={"leader": url})
            self._problem = None
        self.metrics.forwarded.labels("answered").inc()
        return decision

    def _fallback(self, url: str, why: str) -> None:
        """Decide here for a while; say so once per cause, not per pod."""
        self.metrics.forwarded.labels("fallback").inc()
        self._quiet_until = time.monotonic() + self.quiet_s
        problem = f"{url}: {why}"
        if problem != self._problem:
            log.warning(
                "quota leader unreachable; this replica decides its pods itself",
                extra={"leader": url, "error": why},
            )
        self._problem = problem

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
