"""The admission HTTPS app: AdmissionReview in, AdmissionReview out, always HTTP 200.

kube-apiserver treats any non-200 answer as a *call failure* (subject to failurePolicy) and
only ``allowed: false`` as a denial (design K2), so every decision, including our own
internal errors, is an HTTP 200 review; only bodies that are not AdmissionReviews get a 400.
Reviewers are plain async functions, one per path: ``/mutate`` (webhook.mutation) and
``/validate`` (quota) plug in the same way.

How connections reach this app and what a client can hold of the server is
``webhook.transport``'s, and how a body is read within its limits ``webhook.bodies``': this
module answers what each path returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from core.admission import AdmissionRequest, AdmissionResponse, AdmissionReview, ReviewError
from webhook.bodies import (
    LARGE_BODY_BYTES,
    LARGE_BODY_LOOP_SHARE,
    LOOP_SHARE_BURST_S,
    BodyBudget,
    BodyTooLarge,
    LoopShare,
    read_body,
    read_review_in_pieces,
)
from webhook.config import ServerLimits
from webhook.metrics import AdmissionMetrics
from webhook.transport import GUARD, ConnectionGuard

log = logging.getLogger(__name__)

# The admission paths the webhook configurations in deploy/ call (tests/test_deploy_webhooks.py
# checks the manifests against these), and the probe paths the Deployment uses.
MUTATE_PATH = "/mutate"
VALIDATE_PATH = "/validate"
HEALTH_PATH = "/healthz"
READY_PATH = "/readyz"
METRICS_PATH = "/metrics"

Reviewer = Callable[[AdmissionRequest], Awaitable[AdmissionResponse]]
Readiness = Callable[[], str | None]  # None when ready, else why not


def build_app(
    reviewers: Mapping[str, Reviewer],
    *,
    metrics: AdmissionMetrics | None = None,
    readiness: Readiness | None = None,
    limits: ServerLimits | None = None,
    handlers: Mapping[str, Callable[[web.Request], Awaitable[web.Response]]] | None = None,
) -> web.Application:
    """The admission app: ``reviewers`` answer AdmissionReviews at their paths; ``handlers``
    are other POST endpoints served on the same listener (the quota leader's decisions)."""
    metrics = metrics or AdmissionMetrics(CollectorRegistry())
    limits = limits or ServerLimits()
    guard = ConnectionGuard(limits, metrics)
    budget = BodyBudget(limits, metrics)
    share = LoopShare(LARGE_BODY_LOOP_SHARE, LOOP_SHARE_BURST_S)
    # Large pods (many env vars, volumes) exceed aiohttp's 1 MiB default; controller-runtime
    # and pod-security-admission accept 3 MiB and more.
    app = web.Application(client_max_size=limits.max_body_bytes, middlewares=[guard.middleware])
    app[GUARD] = guard
    for path, reviewer in reviewers.items():
        app.router.add_post(
            path, _Endpoint(path, reviewer, metrics, limits, budget=budget, share=share).handle
        )
    for path, handler in (handlers or {}).items():
        app.router.add_post(path, handler)

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def readyz(_: web.Request) -> web.Response:
        why = readiness() if readiness else None
        if why:
            return web.Response(status=503, text=f"not ready: {why}\n")
        return web.Response(text="ok\n")

    async def prometheus(_: web.Request) -> web.Response:
        body = generate_latest(metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    app.router.add_get(HEALTH_PATH, healthz)
    app.router.add_get(READY_PATH, readyz)
    app.router.add_get(METRICS_PATH, prometheus)
    return app


class _Endpoint:
    """One review path: its body let in and read within the limits, then answered by its
    reviewer (failing closed), counted and logged."""

    def __init__(
        self,
        path: str,
        reviewer: Reviewer,
        metrics: AdmissionMetrics,
        limits: ServerLimits,
        *,
        budget: BodyBudget,
        share: LoopShare,
    ) -> None:
        self.path = path
        self.reviewer = reviewer
        self.metrics = metrics
        self.limits = limits
        self.budget = budget
        self.share = share
        self.too_large = (
            f"request body larger than {limits.max_body_bytes} bytes "
            "(server.limits.max_body_bytes); an AdmissionReview of a pod is a few KiB, a very "
            "large pod a few MiB"
        )

    def _refused(self, reason: str, status: int, message: str) -> web.Response:
        self.metrics.bodies_refused.labels(self.path, reason).inc()
        log.warning(
            "request body refused",
            extra={"path": self.path, "reason": reason, "status": status, "error": message},
        )
        return _bad_request(message, status=status)

    async def handle(self, request: web.Request) -> web.Response:
        started = time.perf_counter()
        limits = self.limits
        declared = request.content_length
        if declared is not None and declared > limits.max_body_bytes:
            return self._refused("too-large", 413, self.too_large)
        # A chunked body has no declared size: it is charged the most it may grow to.
        size = declared if declared is not None else limits.max_body_bytes
        async with contextlib.AsyncExitStack() as held:
            deadline = asyncio.get_running_loop().time() + limits.body_timeout_seconds
            try:
                async with asyncio.timeout_at(deadline):
                    await held.enter_async_context(self.budget.hold(size))
            except TimeoutError:
                return self._refused(
                    "busy",
                    503,
                    f"no room for a {size}-byte body within "
                    f"{limits.body_timeout_seconds:g} s: large bodies share half of "
                    f"server.limits.max_inflight_body_bytes ({limits.max_inflight_body_bytes}) "
                    "and are let in at server.limits.large_body_bytes_per_second "
                    f"({limits.large_body_bytes_per_second}); retry later",
                )
            review = await self._read(request, size, deadline)
            if isinstance(review, web.Response):
                return review
            return await self._review(review, started)

    async def _read(
        self, request: web.Request, size: int, deadline: float
    ) -> AdmissionReview | web.Response:
        """The review the body holds, read by ``deadline``; or the answer to a body that is
        none, too large, too slow, or abandoned."""
        limits = self.limits
        try:
            async with asyncio.timeout_at(deadline):
                if size > LARGE_BODY_BYTES:
                    review = await read_review_in_pieces(request, limits.max_body_bytes, self.share)
                else:
                    review = AdmissionReview.parse(await read_body(request, limits.max_body_bytes))
        except ReviewError as exc:
            self.metrics.bad_requests.labels(self.path).inc()
            log.warning("bad admission request", extra={"path": self.path, "error": str(exc)})
            return _bad_request(str(exc))
        except BodyTooLarge:
            return self._refused("too-large", 413, self.too_large)
        except TimeoutError:
            return self._refused(
                "timeout",
                408,
                f"request body not received within {limits.body_timeout_seconds:g} s "
                "(server.limits.body_timeout_seconds)",
            )
        except (ConnectionError, web.RequestPayloadError) as exc:
            # The client went away mid-body: nothing to answer, nothing to fix here.
            self.metrics.bodies_refused.labels(self.path, "abandoned").inc()
            log.info(
                "client abandoned its request body",
                extra={
                    "path": self.path,
                    "declared_bytes": request.content_length,
                    "error": str(exc),
                },
            )
            return web.Response(status=400)
        return review

    async def _review(self, review: AdmissionReview, started: float) -> web.Response:
        assert review.request is not None  # parse() guarantees it
        req = review.request
        try:
            response = await self.reviewer(req)
        except Exception:
            # Fail closed, and say where to look: a denial is always safe for a GPU pod, an
            # HTTP 500 would be a call failure that failurePolicy Ignore turns into "allow".
            log.exception("admission reviewer failed", extra={"uid": req.uid, "path": self.path})
            response = AdmissionResponse.deny(
                req.uid,
                "fracgpu admission failed internally; the pod was not admitted. Retry, and if "
                "it persists ask the cluster operator to check the fracgpu webhook logs "
                f"for uid {req.uid}",
                code=500,
                reason="InternalError",
                label="internal-error",
            )
        elapsed = time.perf_counter() - started
        outcome = "allowed" if response.allowed else "denied"
        self.metrics.reviews.labels(self.path, outcome, response.label).inc()
        self.metrics.latency.labels(self.path).observe(elapsed)
        if not response.allowed or log.isEnabledFor(logging.DEBUG):
            self._log(req, response, elapsed)
        return web.Response(body=review.reply(response), content_type="application/json")

    def _log(self, req: AdmissionRequest, response: AdmissionResponse, elapsed: float) -> None:
        log.info(
            "admission",
            extra={
                "path": self.path,
                "uid": req.uid,
                "operation": req.operation,
                "kind": req.kind.kind,
                "namespace": req.namespace,
                "object": req.display_name,
                "allowed": response.allowed,
                "reason": response.label,
                "denial": response.status.message if response.status else None,
                "dry_run": req.dry_run,
                "ms": round(elapsed * 1000, 3),
            },
        )


def _bad_request(message: str, *, status: int = 400) -> web.Response:
    return web.json_response({"error": message}, status=status)
