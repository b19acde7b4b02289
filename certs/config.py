"""Configuration of the webhook's certificates (docs/certificates.md explains every default).

Three modes decide where the serving certificate comes from:

``directory``  fracgpu issues and rotates a CA and a serving certificate itself and keeps them in a
               local directory (key files 0600). Standalone (``fracgpu serve --standalone``) and
               development outside a cluster.
``secret``     the same, kept in a Kubernetes Secret so that every replica serves the same
               certificate; the API server's resourceVersion decides races between replicas.
``files``      the certificate is issued by someone else (cert-manager) and mounted as files;
               fracgpu only reloads them when their content changes.

Durations accept seconds (``3600``) or ISO 8601 (``P30D``, ``PT10M``).
"""

from __future__ import annotations

import ipaddress
from datetime import timedelta
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

KeyAlgorithm = Literal["ecdsa-p256", "rsa-2048", "rsa-3072", "rsa-4096"]
Mode = Literal["directory", "secret", "files"]

# Standalone servers are reached on the loopback interface only.
STANDALONE_HOSTS = ("localhost",)
STANDALONE_IPS = ("127.0.0.1", "::1")


class CertsConfig(BaseModel):
    """Where the webhook's certificate comes from, how long it lives and where its CA goes."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Mode = "directory"
    # directory mode: the local store (created 0700 if missing).
    directory: Path = Path(".local/certs")

    # The Service the API server calls; its DNS names are the certificate's SANs.
    service: str = "fracgpu-webhook"
    namespace: str = "fracgpu"
    # Extra SANs, e.g. a node address for a url-based webhook. Standalone adds localhost,
    # 127.0.0.1 and ::1 itself.
    hosts: list[str] = Field(default_factory=list)
    ips: list[str] = Field(default_factory=list)

    # Keys: ECDSA P-256 is small and fast to handshake; RSA for environments that insist on it.
    key_algorithm: KeyAlgorithm = "ecdsa-p256"
    # The CA lives a year and is replaced `ca_renew_before` its end. The new CA enters the
    # caBundle at once, next to the old one; the serving certificate switches to it only after
    # `ca_propagation`, so every API server has seen the new bundle first. The old CA stays in
    # the bundle until it expires.
    ca_lifetime: timedelta = timedelta(days=365)
    ca_renew_before: timedelta = timedelta(days=60)
    ca_propagation: timedelta = timedelta(minutes=10)
    # The serving certificate is short-lived, so rotation runs every few weeks and a broken
    # rotation is noticed long before anything expires. It is renewed once `serving_renew_at`
    # of its life has passed (2/3 of 30 days: ten days of slack).
    serving_lifetime: timedelta = timedelta(days=30)
    serving_renew_at: float = Field(default=2 / 3, gt=0.0, lt=1.0)
    # Certificates start this long before they are issued, for clocks that run behind.
    backdate: timedelta = timedelta(hours=1)

    # secret mode: the Secret (in `namespace`) that holds CA and serving certificate.
    secret_name: str = "fracgpu-webhook-tls"
    # How often a replica re-reads the store (secret or directory) to pick up a certificate that
    # another replica or `fracgpu certs rotate` renewed, and checks whether rotation is due.
    check_interval: timedelta = timedelta(seconds=30)

    # caBundle injection: None means "yes, unless mode is files" (cert-manager's cainjector
    # owns caBundle then, through the cert-manager.io/inject-ca-from annotation).
    inject: bool | None = None
    # The names deploy/ gives the two configurations (a test checks that they agree).
    mutating_webhook_configurations: list[str] = Field(default_factory=lambda: ["fracgpu-mutate"])
    validating_webhook_configurations: list[str] = Field(
        default_factory=lambda: ["fracgpu-validate"]
    )

    # files mode: a mounted kubernetes.io/tls Secret (cert-manager writes tls.crt, tls.key,
    # ca.crt). Polled by content hash: inotify misses the symlink swaps kubelet does.
    cert_file: Path = Path("/etc/fracgpu/tls/tls.crt")
    key_file: Path = Path("/etc/fracgpu/tls/tls.key")
    ca_file: Path = Path("/etc/fracgpu/tls/ca.crt")
    file_poll_interval: timedelta = timedelta(seconds=10)

    @field_validator("ips")
    @classmethod
    def _valid_ips(cls, value: list[str]) -> list[str]:
        for ip in value:
            try:
                ipaddress.ip_address(ip)
            except ValueError:
                raise ValueError(
                    f"certs.ips: {ip!r} is not an IP address; put DNS names in certs.hosts"
                ) from None
        return value

    @model_validator(mode="after")
    def _consistent_lifetimes(self) -> CertsConfig:
        positive = {
            "ca_lifetime": self.ca_lifetime,
            "ca_renew_before": self.ca_renew_before,
            "serving_lifetime": self.serving_lifetime,
            "check_interval": self.check_interval,
            "file_poll_interval": self.file_poll_interval,
        }
        for name, value in positive.items():
            if value <= timedelta(0):
                raise ValueError(f"certs.{name} must be positive, got {value}")
        if self.ca_propagation < timedelta(0) or self.backdate < timedelta(0):
            raise ValueError("certs.ca_propagation and certs.backdate must not be negative")
        if self.ca_renew_before >= self.ca_lifetime:
            raise ValueError(
                f"certs.ca_renew_before ({self.ca_renew_before}) must be shorter than "
                f"certs.ca_lifetime ({self.ca_lifetime}), or the CA would be renewed forever"
            )
        if self.ca_propagation >= self.ca_renew_before:
            raise ValueError(
                f"certs.ca_propagation ({self.ca_propagation}) must be shorter than "
                f"certs.ca_renew_before ({self.ca_renew_before}): the serving certificate has "
                "to move to the new CA before the old one expires"
            )
        if self.serving_lifetime > self.ca_lifetime:
            raise ValueError(
                f"certs.serving_lifetime ({self.serving_lifetime}) must not exceed "
                f"certs.ca_lifetime ({self.ca_lifetime})"
            )
        return self

    @property
    def injects(self) -> bool:
        """Whether this process writes caBundle into the webhook configurations."""
        return self.mode != "files" if self.inject is None else self.inject

    def service_dns_names(self) -> list[str]:
        """The names the API server may use for the Service (it dials ``<svc>.<ns>.svc``)."""
        svc, ns = self.service, self.namespace
        return [svc, f"{svc}.{ns}", f"{svc}.{ns}.svc", f"{svc}.{ns}.svc.cluster.local"]

    def subject_alt_names(self, *, standalone: bool) -> tuple[list[str], list[str]]:
        """The DNS names and IP addresses the serving certificate must carry, in order."""
        base_hosts = list(STANDALONE_HOSTS) if standalone else self.service_dns_names()
        base_ips = list(STANDALONE_IPS) if standalone else []
        return _unique(base_hosts + self.hosts), _unique(base_ips + self.ips)

    def for_standalone(self) -> CertsConfig:
        """Standalone always keeps its certificates in a directory and talks to no cluster."""
        return self.model_copy(update={"mode": "directory", "inject": False})


def _unique(items: list[str]) -> list[str]:
    return list(dict.fromkeys(items))
