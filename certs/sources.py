"""Where the serving certificate comes from: managed by fracgpu, or mounted files.

A source answers two questions: what to serve now (``refresh``), and when to ask again
(``next_check``). ``ManagedSource`` also rotates: each refresh re-reads the store, runs the
rotation plan and writes its result with compare-and-swap.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Protocol

from certs.config import CertsConfig
from certs.material import Material, MaterialError, ServingState, fingerprint
from certs.metrics import CertsMetrics
from certs.rotation import Request, next_due, plan
from certs.stores import CertificateStore, StoreConflict

log = logging.getLogger(__name__)

Clock = Callable[[], datetime]
MAX_CONFLICTS = 10
# The configuration keys of the mounted files, in the order chain, key, trusted CAs.
FILE_KEYS = ("cert_file", "key_file", "ca_file")


def utcnow() -> datetime:
    return datetime.now(UTC)


class CertificateSource(Protocol):
    async def refresh(self) -> ServingState:
        """What to serve now; renews first if that is due (managed sources)."""
        ...

    def next_check(self) -> float:
        """Seconds until ``refresh`` should run again."""
        ...


class ManagedSource:
    """Certificates fracgpu issues and rotates, kept in a ``CertificateStore``."""

    def __init__(
        self,
        store: CertificateStore,
        config: CertsConfig,
        *,
        standalone: bool,
        metrics: CertsMetrics | None = None,
        clock: Clock = utcnow,
    ) -> None:
        self.store = store
        self.config = config
        self.standalone = standalone
        self.metrics = metrics
        self.clock = clock
        self.material: Material | None = None

    async def refresh(self) -> ServingState:
        return (await self.ensure()).serving_state()

    async def ensure(self, request: Request | None = None) -> Material:
        """Reads the store, renews what is due (or requested), writes it back with
        compare-and-swap and returns what is stored afterwards. On a lost race, re-reads: the
        winner's certificates usually leave nothing to do."""
        for _ in range(MAX_CONFLICTS):
            files, version = await self.store.load()
            current = self._parse(files)
            result = plan(
                current, self.config, standalone=self.standalone, now=self.clock(), request=request
            )
            if not result.changed:
                self.material = result.material
                return result.material
            try:
                await self.store.save(result.material.to_files(), version)
            except StoreConflict:
                log.info(
                    "certificate store changed while renewing; re-reading the winner's",
                    extra={"store": self.store.description},
                )
                if self.metrics:
                    self.metrics.conflicts.inc()
                # An explicit request (the CLI) is applied again on top of the winner's state:
                # the operator asked for it, and servers never send one.
                continue
            if self.metrics:
                self.metrics.rotations.inc()
            serving = result.material.serving.cert
            log.info(
                "certificates renewed",
                extra={
                    "store": self.store.description,
                    "reasons": list(result.reasons),
                    "serving_fingerprint": fingerprint(serving),
                    "serving_not_after": serving.not_valid_after_utc.isoformat(),
                    "ca_fingerprint": fingerprint(result.material.ca.cert),
                },
            )
            self.material = result.material
            return result.material
        raise StoreConflict(
            f"{self.store.description} kept changing during {MAX_CONFLICTS} renewal attempts"
        )

    def _parse(self, files: dict[str, bytes] | None) -> Material | None:
        if files is None:
            return None
        try:
            return Material.from_files(files)
        except MaterialError as exc:
            # Unusable certificates serve nobody: replace them, loudly.
            log.warning(
                "stored certificates are unusable; issuing new ones",
                extra={"store": self.store.description, "problem": str(exc)},
            )
            return None

    def next_check(self) -> float:
        interval = self.config.check_interval.total_seconds()
        if self.material is None:
            return interval
        now = self.clock()
        due = (next_due(self.material, self.config, now) - now).total_seconds()
        return max(0.0, min(interval, due))


class FileSource:
    """Externally issued certificates mounted as files (cert-manager). Polled by content hash:
    kubelet updates Secret volumes by swapping a symlink, which inotify watches miss."""

    def __init__(self, config: CertsConfig) -> None:
        self.config = config
        self._digest: str | None = None
        self._state: ServingState | None = None

    def _paths(self) -> tuple[Path, Path, Path]:
        return self.config.cert_file, self.config.key_file, self.config.ca_file

    def _read(self) -> tuple[bytes, bytes, bytes]:
        contents = []
        for path, key in zip(self._paths(), FILE_KEYS, strict=True):
            try:
                contents.append(path.read_bytes())
            except OSError as exc:
                raise MaterialError(
                    f"{path} (certs.{key}): cannot read it: {exc.strerror or exc}; check that "
                    "the Secret named in the deployment exists and is mounted there, readable "
                    f"by the webhook's user, or set certs.{key} to where it is mounted"
                ) from exc
        return contents[0], contents[1], contents[2]

    async def refresh(self) -> ServingState:
        try:
            chain, key, ca = await asyncio.to_thread(self._read)
        except MaterialError as exc:
            if self._state is None:
                raise
            log.warning(
                "mounted certificate files unreadable; serving the previous ones",
                extra={"problem": str(exc)},
            )
            return self._state
        digest = hashlib.sha256(chain + b"\0" + key + b"\0" + ca).hexdigest()
        if digest == self._digest and self._state is not None:
            return self._state
        cert_name, key_name, ca_name = (
            f"{path} (certs.{k})" for path, k in zip(self._paths(), FILE_KEYS, strict=True)
        )
        try:
            state = ServingState.from_pem(
                chain=chain, key=key, trusted=ca, names=(cert_name, key_name, ca_name)
            )
        except MaterialError as exc:
            if self._state is None:
                raise MaterialError(
                    f"{exc}; re-issue the Secret (for cert-manager: `cmctl renew` the "
                    "Certificate, or delete the Secret) or point certs.cert_file, "
                    "certs.key_file and certs.ca_file at a matching certificate and key"
                ) from exc
            # Mid-update or broken: keep serving the last good certificate and look again.
            log.warning(
                "mounted certificate files unusable; serving the previous ones",
                extra={"problem": str(exc)},
            )
            return self._state
        self._digest, self._state = digest, state
        leaf = state.leaf
        if not leaf.not_valid_before_utc <= utcnow() < leaf.not_valid_after_utc:
            # Someone else issues these: all fracgpu can do is say so, loudly, every time the
            # files change (the readiness probe fails meanwhile).
            log.error(
                "mounted serving certificate is not valid now; its issuer must renew it",
                extra={
                    "file": str(self.config.cert_file),
                    "not_before": leaf.not_valid_before_utc.isoformat(),
                    "not_after": leaf.not_valid_after_utc.isoformat(),
                },
            )
        return state

    def next_check(self) -> float:
        return self.config.file_poll_interval.total_seconds()
