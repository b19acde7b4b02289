"""The fracgpu kube-scheduler's client certificate for the extender listener, issued by
fracgpu's CA into a Secret of its own and kept current there.

Why a client certificate: the extender's bind verb binds pods with serve's permissions, so its
listener must know its caller; kube-scheduler's extender client can present a certificate
(``tlsConfig.certFile``/``keyFile``) and nothing else (no bearer token), so the listener requires
one signed by fracgpu's CA (``certs.tlspolicy.mutual_server_context``).

The Secret (``kubernetes.io/tls``) holds ``tls.crt`` and ``tls.key`` (the client certificate,
clientAuth only) and ``ca.crt``: every CA the extender's serving certificate may be signed by
(the bundle), for the scheduler's ``caFile``. The scheduler mounts it; client-go re-reads a
certificate and key given as files at each new connection, so a renewal needs no restart; it
reads ``caFile`` once, at start, so a CA rotation does. The keeper does it: when it writes a
``ca.crt`` that differs from the one stored (a new CA entered the bundle, or an old one left),
it stamps the bundle's fingerprint on the scheduler Deployment's pod template, which rolls the
scheduler's pods; the serving certificate moves to a new CA only ``ca_propagation`` (10 minutes)
later, by when the restarted scheduler trusts it (docs/certificates.md).

Every replica runs the keeper; the Secret's resourceVersion decides races, as for the serving
certificate (``certs.secretstore``): a loser re-reads at its next check and finds nothing to do.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Awaitable, Callable
from datetime import datetime

from certs.config import CertsConfig
from certs.issuance import Issued, issue_client, key_matches, signed_by
from certs.material import (
    CA_CERT,
    TLS_CERT,
    TLS_KEY,
    Material,
    MaterialError,
    fingerprint,
    parse_certs,
    parse_key,
)
from certs.rotation import ca_propagated_at
from certs.secretstore import SecretStore
from certs.sources import Clock, utcnow
from certs.stores import Files, StoreConflict
from core.kube import DEPLOYMENTS, Api, KubeError, KubeNotFound, call_json

log = logging.getLogger(__name__)

CLIENT_FILES = (TLS_CERT, TLS_KEY, CA_CERT)
SCHEDULER_COMMON_NAME = "fracgpu-scheduler"
# On the scheduler Deployment's pod template: the CA bundle its pods were started with.
CA_STAMP_ANNOTATION = "fracgpu.io/scheduler-ca-bundle"


def bundle_stamp(bundle_pem: bytes) -> str:
    return "sha256:" + hashlib.sha256(bundle_pem).hexdigest()


def deployment_restarter(api: Api, namespace: str, name: str) -> Callable[[str], Awaitable[None]]:
    """Roll Deployment ``name``'s pods by stamping ``stamp`` on its pod template (what
    ``kubectl rollout restart`` does with a time). A Deployment that is not there (the operator
    runs the scheduler another way) is logged with what to do; other failures raise, to be
    retried at the next check."""

    async def restart(stamp: str) -> None:
        patch = {"spec": {"template": {"metadata": {"annotations": {CA_STAMP_ANNOTATION: stamp}}}}}
        try:
            await call_json(
                api,
                "PATCH",
                DEPLOYMENTS.path(namespace, name),
                body=patch,
                content_type="application/strategic-merge-patch+json",
            )
        except KubeNotFound:
            log.warning(
                "the scheduler's trusted CAs changed but its Deployment was not found: restart "
                "the scheduler that mounts the client certificate Secret within "
                "certs.ca_propagation, or its calls to the extender fail once the serving "
                "certificate moves to the new CA",
                extra={"deployment": f"{namespace}/{name}", "stamp": stamp},
            )
            return
        log.info(
            "scheduler restarted to trust the new CA bundle",
            extra={"deployment": f"{namespace}/{name}", "stamp": stamp},
        )

    return restart


def reissue_reason(
    files: Files | None, material: Material, config: CertsConfig, now: datetime
) -> str | None:
    """Why the stored client certificate must be issued again now; None if it may stay.

    It lives ``serving_lifetime`` and is renewed at ``serving_renew_at`` of it, like the serving
    certificate. It moves to a new CA only once every replica trusts that CA
    (``ca_propagation``), and its ``ca.crt`` follows the bundle, so that a scheduler started
    after a CA rotation trusts the CA the serving certificate moves to.
    """
    if files is None:
        return "no client certificate stored yet"
    missing = [name for name in CLIENT_FILES if name not in files]
    if missing:
        return f"missing {', '.join(missing)}"
    try:
        cert = parse_certs(TLS_CERT, files[TLS_CERT])[0]
        key = parse_key(TLS_KEY, files[TLS_KEY])
    except MaterialError as exc:
        return f"unusable: {exc}"
    if not key_matches(cert, key):
        return f"{TLS_KEY} does not belong to {TLS_CERT}"
    start, end = cert.not_valid_before_utc, cert.not_valid_after_utc
    if not start <= now < end:
        return f"not valid now (valid {start.isoformat()} to {end.isoformat()})"
    if end - now <= config.ca_propagation:
        return f"expires at {end.isoformat()}"
    if not any(signed_by(cert, ca) for ca in material.trusted):
        return "signed by no CA in the bundle"
    if now >= start + (end - start) * config.serving_renew_at:
        return f"renewal due (expires {end.isoformat()})"
    if not signed_by(cert, material.ca.cert) and now >= ca_propagated_at(material.ca, config):
        return "moves to the new CA"
    if files[CA_CERT] != material.bundle_pem():
        return "the trusted CAs changed"
    return None


def issue(material: Material, config: CertsConfig, now: datetime, common_name: str) -> Files:
    """The Secret's files: a new client certificate from the current CA, and the bundle."""
    client: Issued = issue_client(
        material.ca,
        common_name=common_name,
        lifetime=config.serving_lifetime,
        now=now,
        backdate=config.backdate,
        algorithm=config.key_algorithm,
    )
    return {TLS_CERT: client.cert_pem(), TLS_KEY: client.key_pem(), CA_CERT: material.bundle_pem()}


class ClientCertificateKeeper:
    """Keeps the scheduler's client certificate in ``secret_name`` current, from the CA that
    ``material`` returns (the serving certificate's source: None until it has read its store)."""

    def __init__(
        self,
        api: Api,
        config: CertsConfig,
        secret_name: str,
        material: Callable[[], Material | None],
        *,
        common_name: str = SCHEDULER_COMMON_NAME,
        clock: Clock = utcnow,
        restart: Callable[[str], Awaitable[None]] | None = None,
    ) -> None:
        self.store = SecretStore(api, config.namespace, secret_name, keys=CLIENT_FILES)
        self.config = config
        self.material = material
        self.common_name = common_name
        self.clock = clock
        self.restart = restart
        # The bundle stamp the scheduler must be restarted with, until that succeeds.
        self.restart_due: str | None = None

    async def ensure(self) -> str | None:
        """One check: issues and stores a new certificate if one is due; why it did, or None.

        A lost race (409) is no error: the winner's certificate is read at the next check."""
        material = self.material()
        if material is None:
            return None
        files, version = await self.store.load()
        now = self.clock()
        reason = reissue_reason(files, material, self.config, now)
        if reason is None:
            await self._restart_if_due()
            return None
        issued = issue(material, self.config, now, self.common_name)
        try:
            await self.store.save(issued, version)
        except StoreConflict:
            log.info("client certificate Secret changed meanwhile; re-reading it next check")
            return None
        if files and files.get(CA_CERT) and files[CA_CERT] != issued[CA_CERT]:
            # Not at first issue: the scheduler starts with this bundle, nothing to restart.
            self.restart_due = bundle_stamp(issued[CA_CERT])
        await self._restart_if_due()
        cert = parse_certs(TLS_CERT, issued[TLS_CERT])[0]
        log.info(
            "scheduler client certificate issued",
            extra={
                "store": self.store.description,
                "reason": reason,
                "fingerprint": fingerprint(cert),
                "not_after": cert.not_valid_after_utc.isoformat(),
            },
        )
        return reason

    async def _restart_if_due(self) -> None:
        if self.restart_due is None or self.restart is None:
            return
        try:
            await self.restart(self.restart_due)
        except KubeError as exc:
            log.error(
                "restarting the scheduler for the new CA bundle failed; retrying next check",
                extra={"error": str(exc), "stamp": self.restart_due},
            )
            return
        self.restart_due = None

    async def run(self) -> None:
        """Check every ``check_interval`` until cancelled; a failed check is logged and retried
        (the stored certificate has days of validity left when its renewal falls due)."""
        while True:
            try:
                await self.ensure()
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
                log.error(
                    "scheduler client certificate check failed",
                    extra={"store": self.store.description, "error": error},
                )
            await asyncio.sleep(self.config.check_interval.total_seconds())
