"""When to issue, renew and retire certificates: a pure function of what is stored and the time.

Timeline of one CA generation (defaults in certs/config.py)::

    CA₁ issued ─────────────── renew point (ca_lifetime − ca_renew_before) ──────── CA₁ expires
                               │ CA₂ issued; bundle = CA₂ + CA₁ (injected at once)
                               │ ── ca_propagation ── serving cert re-issued by CA₂
                               │                                          bundle = CA₂ ─┘

The serving certificate is renewed once ``serving_renew_at`` of its validity has passed, and
at once when it is unusable (expired or about to, wrong SANs, signed by a CA nobody trusts).
It moves to a new CA only after ``ca_propagation``, so that every API server has the new CA in
its caBundle before it sees a certificate signed by it. Old CAs leave the bundle when they
expire; by then nothing they signed is valid either.

Every replica runs this function; the store's compare-and-swap makes one of them win and the
others re-read, find nothing to do, and serve the winner's certificates.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from certs.config import CertsConfig
from certs.issuance import (
    Issued,
    issue_ca,
    issue_serving,
    normalise_ips,
    san_sets,
    signed_by,
)
from certs.material import Material

CA_COMMON_NAME = "fracgpu webhook CA"


@dataclass(frozen=True, slots=True)
class Plan:
    material: Material
    reasons: tuple[str, ...]  # empty: nothing to change

    @property
    def changed(self) -> bool:
        return bool(self.reasons)


@dataclass(frozen=True, slots=True)
class Request:
    """What an operator asked for (``fracgpu certs rotate``), on top of what is due."""

    serving: bool = False
    ca: bool = False
    # Skip the overlap: the new CA replaces the bundle and signs the serving certificate now.
    # For a leaked CA key only; API servers that have not seen the new bundle fail calls.
    immediate: bool = False


def _new_ca(config: CertsConfig, now: datetime) -> Issued:
    return issue_ca(
        common_name=CA_COMMON_NAME,
        lifetime=config.ca_lifetime,
        now=now,
        backdate=config.backdate,
        algorithm=config.key_algorithm,
    )


def _new_serving(ca: Issued, config: CertsConfig, standalone: bool, now: datetime) -> Issued:
    hosts, ips = config.subject_alt_names(standalone=standalone)
    return issue_serving(
        ca,
        hosts=hosts,
        ips=ips,
        lifetime=config.serving_lifetime,
        now=now,
        backdate=config.backdate,
        algorithm=config.key_algorithm,
    )


def ca_renew_point(ca: Issued, config: CertsConfig) -> datetime:
    return ca.cert.not_valid_after_utc - config.ca_renew_before


def ca_propagated_at(ca: Issued, config: CertsConfig) -> datetime:
    """When every API server is assumed to trust ``ca`` (issue time + ``ca_propagation``)."""
    return ca.cert.not_valid_before_utc + config.backdate + config.ca_propagation


def serving_renew_point(serving: Issued, config: CertsConfig) -> datetime:
    start, end = serving.cert.not_valid_before_utc, serving.cert.not_valid_after_utc
    return start + (end - start) * config.serving_renew_at


def _fresh(config: CertsConfig, standalone: bool, now: datetime, reason: str) -> Plan:
    ca = _new_ca(config, now)
    return Plan(Material(ca, (ca.cert,), _new_serving(ca, config, standalone, now)), (reason,))


def _algorithm_matches(issued: Issued, config: CertsConfig) -> bool:
    if config.key_algorithm == "ecdsa-p256":
        return isinstance(issued.key, ec.EllipticCurvePrivateKey)
    return not isinstance(issued.key, ec.EllipticCurvePrivateKey) and (
        issued.key.key_size == int(config.key_algorithm.removeprefix("rsa-"))
    )


def plan(
    current: Material | None,
    config: CertsConfig,
    *,
    standalone: bool,
    now: datetime,
    request: Request | None = None,
) -> Plan:
    """The certificates that should be stored now, and why they differ from ``current``."""
    request = request or Request()
    if current is None:
        return _fresh(config, standalone, now, "no certificates stored yet")
    if current.ca.cert.not_valid_after_utc <= now:
        return _fresh(
            config, standalone, now, f"the CA expired at {current.ca.cert.not_valid_after_utc}"
        )
    if current.ca.cert.not_valid_before_utc > now:
        # Issued by a clock that runs ahead (or this one was stepped back): nothing it signed
        # is valid yet, so the CA and everything under it start over, from this clock.
        return _fresh(config, standalone, now, _not_yet_valid("the CA", current.ca, now))
    reasons: list[str] = []
    ca = current.ca
    trusted = tuple(c for c in current.trusted if c.not_valid_after_utc > now)
    if len(trusted) < len(current.trusted):
        reasons.append("expired CAs dropped from the bundle")

    ca_reason = _ca_renewal_reason(current.ca, config, now, request)
    if ca_reason is not None:
        ca = _new_ca(config, now)
        trusted = (ca.cert,) if request.immediate else (ca.cert, *trusted)
        reasons.append(ca_reason)

    serving = current.serving
    urgent = _urgent_serving_reason(serving, trusted, config, standalone, now)
    due: str | None = None
    if urgent is None:
        if request.serving:
            due = "serving certificate rotation requested"
        elif now >= serving_renew_point(serving, config):
            due = f"serving certificate renewal due (expires {serving.cert.not_valid_after_utc})"
        elif not signed_by(serving.cert, ca.cert):
            due = "serving certificate moves to the new CA"
        elif not _algorithm_matches(serving, config):
            due = f"serving key algorithm differs from certs.key_algorithm={config.key_algorithm}"
    # Moving to another CA waits until every API server trusts it; renewing under the same CA
    # needs no wait.
    may_switch = (
        request.immediate or signed_by(serving.cert, ca.cert) or now >= ca_propagated_at(ca, config)
    )
    if urgent is not None or (due is not None and may_switch):
        # An urgent renewal in the step that rotates the CA is still signed by the old one:
        # only the old one is known to every API server yet.
        signer = ca if may_switch else current.ca
        serving = _new_serving(signer, config, standalone, now)
        reasons.append(urgent or due or "")
    if ca.cert not in trusted:
        trusted = (ca.cert, *trusted)
        reasons.append("the bundle lacked the current CA")
    return Plan(Material(ca, trusted, serving), tuple(reasons))


def _ca_renewal_reason(
    ca: Issued, config: CertsConfig, now: datetime, request: Request
) -> str | None:
    if request.ca:
        return "CA rotation requested"
    if now >= ca_renew_point(ca, config):
        return f"CA renewal due (expires {ca.cert.not_valid_after_utc})"
    if not _algorithm_matches(ca, config):
        return f"CA key algorithm differs from certs.key_algorithm={config.key_algorithm}"
    return None


def _urgent_serving_reason(
    serving: Issued,
    trusted: tuple[x509.Certificate, ...],
    config: CertsConfig,
    standalone: bool,
    now: datetime,
) -> str | None:
    """Why the stored serving certificate cannot wait for the CA to propagate, if it cannot."""
    cert = serving.cert
    if cert.not_valid_before_utc > now:
        return _not_yet_valid("the serving certificate", serving, now)
    if cert.not_valid_after_utc - now <= config.ca_propagation:
        return f"serving certificate expires at {cert.not_valid_after_utc}"
    hosts, ips = config.subject_alt_names(standalone=standalone)
    have_hosts, have_ips = san_sets(cert)
    if have_hosts != frozenset(hosts) or have_ips != normalise_ips(ips):
        return (
            f"serving certificate names {sorted(have_hosts | have_ips)}, "
            f"configuration wants {sorted(set(hosts) | normalise_ips(ips))}"
        )
    if not any(signed_by(cert, ca) for ca in trusted):
        return "serving certificate is signed by no CA in the bundle"
    return None


def _not_yet_valid(what: str, issued: Issued, now: datetime) -> str:
    start = issued.cert.not_valid_before_utc
    return (
        f"{what} is not valid until {start:%Y-%m-%dT%H:%M:%SZ}, {start - now} after this "
        f"replica's clock ({now:%Y-%m-%dT%H:%M:%SZ}): it was issued by a clock running ahead "
        "by more than certs.backdate, or this clock was set back; every TLS handshake would "
        "fail, so it is re-issued now (check NTP on the nodes)"
    )


def next_due(material: Material, config: CertsConfig, now: datetime) -> datetime:
    """The next moment at which ``plan`` may change something (without a request)."""
    points = [ca_renew_point(material.ca, config), serving_renew_point(material.serving, config)]
    points.append(material.serving.cert.not_valid_after_utc - config.ca_propagation)
    points += [c.not_valid_after_utc for c in material.trusted if c != material.ca.cert]
    if not signed_by(material.serving.cert, material.ca.cert):
        points.append(ca_propagated_at(material.ca, config))
    return max(min(points), now)
