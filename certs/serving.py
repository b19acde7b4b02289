"""The admission server's TLS: one SSLContext that always serves the current certificate.

The admission server gets ``ServingCertificates.context`` once, for its TLS site. That
context never changes; its SNI callback, which OpenSSL runs for every ClientHello (with or
without a server name), points the handshake at the newest context built from the newest
certificate. A renewal therefore takes effect at the next handshake, connections already open
carry on with the certificate they negotiated, and the site is never restarted: no request
fails because of a rotation. A new context is built completely before it is swapped in, so a
handshake never sees a new certificate with an old key.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from prometheus_client import CollectorRegistry

from certs.config import CertsConfig
from certs.inject import CaBundleInjector
from certs.material import MaterialError, ServingState, fingerprint
from certs.metrics import CertsMetrics
from certs.secretstore import SecretStore
from certs.sources import CertificateSource, Clock, FileSource, ManagedSource, utcnow
from certs.stores import CertificateStore, DirectoryStore
from certs.tlspolicy import mutual_server_context, server_context
from core.kube import Api, KubeError, kube_client

log = logging.getLogger(__name__)

ERROR_BACKOFF_S = (1.0, 30.0)


class ServingError(Exception):
    """No certificate can be served at start; the message (one line) names the file, directory
    or Secret, the problem and the fix."""


class BundleConsumer(Protocol):
    """Something that must follow the CA bundle (the caBundle injector)."""

    async def run(self, bundle: Callable[[], bytes], changed: asyncio.Event) -> None: ...


class ServingCertificates:
    def __init__(
        self,
        source: CertificateSource,
        initial: ServingState,
        *,
        metrics: CertsMetrics,
        consumers: tuple[BundleConsumer, ...] = (),
        resources: contextlib.AsyncExitStack | None = None,
    ) -> None:
        self.source = source
        self._resources = resources or contextlib.AsyncExitStack()
        self.metrics = metrics
        self.consumers = consumers
        self._state = initial
        self._current = server_context(initial)
        self._bundle_changed = asyncio.Event()
        # The context aiohttp holds: its own certificate is the first one, and every handshake
        # is moved to the current context by the callback.
        self.context = server_context(initial)
        self.context.sni_callback = self._select_context
        # The same certificate, for a listener that requires a client certificate from a
        # trusted CA (the scheduler extender's). The handshake keeps the verify mode of the
        # context it started with and verifies against the store of the one it is moved to:
        # both require, and the moved-to one trusts the current bundle.
        self._current_mutual = mutual_server_context(initial)
        self.mutual_context = mutual_server_context(initial)
        self.mutual_context.sni_callback = self._select_mutual
        metrics.observe(initial)

    def _select_context(
        self, sslobj: ssl.SSLObject, server_name: str | None, context: ssl.SSLContext
    ) -> None:
        sslobj.context = self._current

    def _select_mutual(
        self, sslobj: ssl.SSLObject, server_name: str | None, context: ssl.SSLContext
    ) -> None:
        sslobj.context = self._current_mutual

    @property
    def state(self) -> ServingState:
        return self._state

    def ca_bundle_pem(self) -> bytes:
        """The CAs clients must trust (what goes into caBundle)."""
        return self._state.bundle_pem()

    def ready(self) -> bool:
        """Whether the certificate being served is valid now (for the readiness probe)."""
        leaf = self._state.leaf
        return leaf.not_valid_before_utc <= utcnow() < leaf.not_valid_after_utc

    async def refresh(self) -> bool:
        """Asks the source for the current certificate and swaps it in if it changed."""
        return self.install(await self.source.refresh())

    def install(self, state: ServingState) -> bool:
        if state.digest() == self._state.digest():
            return False
        bundle_changed = state.bundle_pem() != self._state.bundle_pem()
        self._current = server_context(state)
        self._current_mutual = mutual_server_context(state)
        self._state = state
        self.metrics.reloads.inc()
        self.metrics.observe(state)
        log.info(
            "serving a new certificate",
            extra={
                "fingerprint": fingerprint(state.leaf),
                "not_after": state.leaf.not_valid_after_utc.isoformat(),
                "trusted_cas": [fingerprint(c) for c in state.trusted],
            },
        )
        if bundle_changed:
            self._bundle_changed.set()
        return True

    async def close(self) -> None:
        """Closes the Kubernetes client ``open_serving`` opened (if it did)."""
        await self._resources.aclose()

    async def __aenter__(self) -> ServingCertificates:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def run(self) -> None:
        """Keeps the certificate (and the injected caBundle) current until cancelled."""
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(self._refresh_loop())
            for consumer in self.consumers:
                tasks.create_task(consumer.run(self.ca_bundle_pem, self._bundle_changed))

    async def _refresh_loop(self) -> None:
        failures = 0
        while True:
            if failures:
                low, high = ERROR_BACKOFF_S
                delay = min(high, low * 2**failures) * random.uniform(0.5, 1.0)
            else:
                delay = self.source.next_check()
            await asyncio.sleep(delay)
            try:
                await self.refresh()
            except Exception as exc:
                failures += 1
                self.metrics.errors.labels("refresh").inc()
                log.error(
                    "certificate refresh failed; still serving the previous certificate",
                    extra={
                        "error": f"{type(exc).__name__}: {exc}",
                        "not_after": self._state.leaf.not_valid_after_utc.isoformat(),
                    },
                )
            else:
                failures = 0


def _start_failure(config: CertsConfig, exc: OSError | MaterialError | KubeError) -> str:
    if isinstance(exc, MaterialError):  # files mode: the message names the file and the fix
        problem = str(exc)
    elif isinstance(exc, KubeError):
        problem = (
            f"Secret {config.namespace}/{config.secret_name} (certs.secret_name): {exc}; check "
            "that the webhook's ServiceAccount may get, create and update it "
            "(deploy/base/webhook-rbac.yaml) and that certs.namespace is its namespace"
        )
    else:
        where = f" ({exc.filename})" if exc.filename else ""
        problem = (
            f"certs.directory {config.directory}: {exc.strerror or exc}{where}; make it a "
            "directory the webhook's user can read and write, or set certs.directory to one"
        )
    return " ".join(problem.split())  # one line, whatever the underlying library wrote


async def open_serving(
    config: CertsConfig,
    *,
    standalone: bool,
    registry: CollectorRegistry | None = None,
    api: Api | None = None,
    kubeconfig: Path | None = None,
    clock: Clock = utcnow,
) -> ServingCertificates:
    """Loads (issuing if needed) the serving certificate for ``config``; ``run()`` keeps it
    fresh and ``close()`` releases what was opened here.

    ``standalone``: directory mode, SANs localhost/127.0.0.1/::1, no Kubernetes.
    Otherwise a Kubernetes client is needed for ``secret`` mode and for caBundle injection:
    ``api`` if given, else one from ``kubeconfig`` or the in-cluster service account.
    """
    metrics = CertsMetrics(registry or CollectorRegistry())
    if standalone:
        config = config.for_standalone()
    resources = contextlib.AsyncExitStack()
    try:
        if api is None and not standalone and (config.mode == "secret" or config.injects):
            api = await resources.enter_async_context(kube_client(kubeconfig))
        source: CertificateSource
        if config.mode == "files":
            source = FileSource(config)
        else:
            store: CertificateStore = (
                SecretStore(_cluster(api), config.namespace, config.secret_name)
                if config.mode == "secret"
                else DirectoryStore(config.directory)
            )
            source = ManagedSource(
                store, config, standalone=standalone, metrics=metrics, clock=clock
            )
        consumers: tuple[BundleConsumer, ...] = ()
        if not standalone and config.injects:
            consumers = (CaBundleInjector(_cluster(api), config, metrics),)
        initial = await source.refresh()
    except BaseException as exc:
        await resources.aclose()
        if isinstance(exc, OSError | MaterialError | KubeError):
            raise ServingError(_start_failure(config, exc)) from exc
        raise
    return ServingCertificates(
        source, initial, metrics=metrics, consumers=consumers, resources=resources
    )


def _cluster(api: Api | None) -> Api:
    """The client for what needs a cluster (the Secret store, caBundle injection)."""
    if api is None:
        raise MaterialError(
            "certs.mode secret and caBundle injection need a Kubernetes cluster, and this "
            "webhook runs standalone; use certs.mode: directory, or run without --standalone"
        )
    return api
