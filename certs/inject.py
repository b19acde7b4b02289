"""caBundle injection into the project's webhook configurations, kept true by watching them.

The API server verifies the webhook's certificate against ``webhooks[*].clientConfig.caBundle``.
This module writes the CA bundle there, and writes it again whenever the bundle changes (CA
rotation) or a configuration is changed or re-created without it (``kubectl apply`` of the
manifests, a Helm upgrade, a restore). It watches the configurations with an informer and
reconciles level-triggered: every pass compares what is there with what should be there, so a
missed event or a failed write is repaired by the next pass.

Writes are PUTs of the object as read, carrying its resourceVersion: a concurrent edit gets 409
and the next pass works from the newer version. Nothing else in the object is touched.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

from certs.config import CertsConfig
from certs.metrics import CertsMetrics
from core.informer import EventType, Informer
from core.kube import (
    MUTATING_WEBHOOK_CONFIGURATIONS,
    VALIDATING_WEBHOOK_CONFIGURATIONS,
    Api,
    KubeError,
    KubeNotFound,
    RawBody,
    Resource,
    call_json,
)

log = logging.getLogger(__name__)

KINDS: dict[str, Resource] = {
    "MutatingWebhookConfiguration": MUTATING_WEBHOOK_CONFIGURATIONS,
    "ValidatingWebhookConfiguration": VALIDATING_WEBHOOK_CONFIGURATIONS,
}
RETRY_S = (0.5, 30.0)


@dataclass(frozen=True, slots=True)
class Target:
    kind: str
    name: str

    @property
    def resource(self) -> Resource:
        return KINDS[self.kind]

    def __str__(self) -> str:
        return f"{self.kind} {self.name}"


@dataclass(frozen=True, slots=True)
class Injection:
    """What injecting the CA bundle did to one webhook configuration."""

    target: Target
    result: str  # "injected", "unchanged", "absent"
    webhooks: int = 0


def targets(config: CertsConfig) -> list[Target]:
    return [
        Target("MutatingWebhookConfiguration", n) for n in config.mutating_webhook_configurations
    ] + [
        Target("ValidatingWebhookConfiguration", n)
        for n in config.validating_webhook_configurations
    ]


def with_bundle(obj: dict[str, Any], bundle_pem: bytes) -> tuple[dict[str, Any], int]:
    """``obj`` with every webhook's caBundle set to ``bundle_pem``; and how many changed."""
    encoded = base64.b64encode(bundle_pem).decode("ascii")
    changed = 0
    webhooks = []
    for webhook in obj.get("webhooks") or []:
        client_config = dict(webhook.get("clientConfig") or {})
        if client_config.get("caBundle") != encoded:
            client_config["caBundle"] = encoded
            changed += 1
        webhooks.append({**webhook, "clientConfig": client_config})
    return {**obj, "webhooks": webhooks}, changed


class CaBundleInjector:
    def __init__(self, api: Api, config: CertsConfig, metrics: CertsMetrics | None = None) -> None:
        self.api = api
        self.targets = targets(config)
        self.metrics = metrics

    async def inject(
        self, bundle_pem: bytes, objects: dict[Target, dict[str, Any] | None] | None = None
    ) -> list[Injection]:
        """One pass over every target. ``objects`` are the informers' copies; without them
        (the CLI) each target is read first. Raises on the first failed write, after trying
        the others."""
        outcomes: list[Injection] = []
        failure: Exception | None = None
        for target in self.targets:
            try:
                obj = objects.get(target) if objects is not None else await self._get(target)
                outcomes.append(await self._inject_one(target, obj, bundle_pem))
            except KubeError as err:
                failure = failure or err
                if self.metrics:
                    self.metrics.errors.labels("inject").inc()
                log.warning(
                    "caBundle injection failed; retrying",
                    extra={"target": str(target), "error": str(err)},
                )
        if failure is not None:
            raise failure
        return outcomes

    async def _get(self, target: Target) -> dict[str, Any] | None:
        try:
            return await call_json(self.api, "GET", target.resource.path(name=target.name))
        except KubeNotFound:
            return None

    async def _inject_one(
        self, target: Target, obj: dict[str, Any] | None, bundle_pem: bytes
    ) -> Injection:
        if obj is None:
            return Injection(target, "absent")
        desired, changed = with_bundle(obj, bundle_pem)
        if not changed:
            return Injection(target, "unchanged", len(desired["webhooks"]))
        await call_json(self.api, "PUT", target.resource.path(name=target.name), body=desired)
        if self.metrics:
            self.metrics.injections.labels(target.kind, target.name).inc()
        log.info(
            "caBundle injected",
            extra={"target": str(target), "webhooks_changed": changed},
        )
        return Injection(target, "injected", changed)

    async def run(self, bundle: Callable[[], bytes], changed: asyncio.Event) -> None:
        """Injects now, then again whenever the bundle or a target changes, until cancelled."""
        wake = asyncio.Event()
        wake.set()
        names = {(t.kind, t.name) for t in self.targets}

        def on_event(kind: str) -> Callable[[EventType, RawBody], None]:
            def handler(event: EventType, obj: RawBody) -> None:
                if (kind, (obj.get("metadata") or {}).get("name")) in names:
                    wake.set()

            return handler

        informers = {
            kind: Informer(self.api, resource, handler=on_event(kind), name=f"certs-{kind}")
            for kind, resource in KINDS.items()
            if any(t.kind == kind for t in self.targets)
        }

        async def follow_bundle() -> None:
            while True:
                await changed.wait()
                changed.clear()
                wake.set()

        async with asyncio.TaskGroup() as tasks:
            for informer in informers.values():
                tasks.create_task(informer.run())
            tasks.create_task(follow_bundle())
            for informer in informers.values():
                await informer.wait_synced()
            failures = 0
            while True:
                await wake.wait()
                wake.clear()
                cached = {t: _plain(informers[t.kind].get(t.name)) for t in self.targets}
                try:
                    await self.inject(bundle(), cached)
                    failures = 0
                except KubeError:
                    # A 409 means the informer is about to deliver a newer version, which wakes
                    # us; other errors are retried after a backoff.
                    failures += 1
                    low, high = RETRY_S
                    await asyncio.sleep(min(high, low * 2**failures) * random.uniform(0.5, 1.0))
                    wake.set()


def summary(outcomes: Sequence[Injection]) -> list[str]:
    lines = []
    for o in outcomes:
        if o.result == "absent":
            lines.append(f"{o.target}: not found (a running webhook injects it once it exists)")
        elif o.result == "injected":
            lines.append(f"{o.target}: caBundle written into {o.webhooks} webhook(s)")
        else:
            lines.append(f"{o.target}: already current ({o.webhooks} webhook(s))")
    return lines


def _plain(obj: RawBody | None) -> dict[str, Any] | None:
    """The informer's typed view of a webhook configuration, as the JSON the patcher edits."""
    return None if obj is None else cast(dict[str, Any], obj)
