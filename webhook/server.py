"""The admission HTTPS server: AdmissionReview in, AdmissionReview out, always HTTP 200.

kube-apiserver treats any non-200 answer as a *call failure* (subject to failurePolicy) and
only ``allowed: false`` as a denial (design K2), so every decision, including our own
internal errors, is an HTTP 200 review; only bodies that are not AdmissionReviews get a 400.
Reviewers are plain async functions, one per path: ``/mutate`` (webhook.mutation) and
``/validate`` (quota) plug in the same way.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Mapping

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from core.admission import AdmissionRequest, AdmissionResponse, AdmissionReview, ReviewError
from webhook.metrics import AdmissionMetrics

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
# Large pods (many env vars, volumes) exceed aiohttp's 1 MiB default; controller-runtime and
# pod-security-admission accept 3 MiB and more (design K3).
MAX_BODY_BYTES = 8 * 2**20


def build_app(
    reviewers: Mapping[str, Reviewer],
    *,
    metrics: AdmissionMetrics | None = None,
    readiness: Readiness | None = None,
) -> web.Application:
    metrics = metrics or AdmissionMetrics()
    app = web.Application(client_max_size=MAX_BODY_BYTES)
    for path, reviewer in reviewers.items():
        app.router.add_post(path, _endpoint(path, reviewer, metrics))

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


def _endpoint(
    path: str, reviewer: Reviewer, metrics: AdmissionMetrics
) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def handle(request: web.Request) -> web.Response:
        started = time.perf_counter()
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            metrics.bad_requests.labels(path).inc()
            return _bad_request(f"body larger than {MAX_BODY_BYTES} bytes", status=413)
        try:
            review = AdmissionReview.parse(body)
        except ReviewError as exc:
            metrics.bad_requests.labels(path).inc()
            log.warning("bad admission request", extra={"path": path, "error": str(exc)})
            return _bad_request(str(exc))
        assert review.request is not None  # parse() guarantees it
        req = review.request
        try:
            response = await reviewer(req)
        except Exception:
            # Fail closed, and say where to look: a denial is always safe for a GPU pod, an
            # HTTP 500 would be a call failure that failurePolicy Ignore turns into "allow".
            log.exception("admission reviewer failed", extra={"uid": req.uid, "path": path})
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
        metrics.reviews.labels(path, outcome, response.label).inc()
        metrics.latency.labels(path).observe(elapsed)
        if not response.allowed or log.isEnabledFor(logging.DEBUG):
            log.info(
                "admission",
                extra={
                    "path": path,
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
        return web.Response(body=review.reply(response), content_type="application/json")

    return handle


def _bad_request(message: str, *, status: int = 400) -> web.Response:
    return web.json_response({"error": message}, status=status)
