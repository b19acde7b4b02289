"""Issuing a CA, serving certificates and the scheduler's client certificate with ``cryptography``.

The CA is a self-signed root that may only sign end-entity certificates (pathlen 0). The serving
certificate is an end-entity certificate for TLS servers only (serverAuth), with the Service's
DNS names as SANs: the API server checks SANs, never the common name. The scheduler's client
certificate (``certs.clientcert``) is for TLS clients only (clientAuth), so neither can stand in
for the other. All start ``backdate`` before now, because an API server whose clock runs behind
would otherwise see a certificate "not yet valid".
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from certs.config import KeyAlgorithm

PrivateKey = ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey
ORGANIZATION = "fracgpu"


@dataclass(frozen=True, slots=True, eq=False)
class Issued:
    """A certificate and its private key."""

    cert: x509.Certificate
    key: PrivateKey

    def __eq__(self, other: object) -> bool:
        # Key objects compare by identity; the same key read twice must compare equal.
        if not isinstance(other, Issued):
            return NotImplemented
        return self.cert == other.cert and self.key_pem() == other.key_pem()

    def __hash__(self) -> int:
        return hash(self.cert)

    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def key_pem(self) -> bytes:
        return key_to_pem(self.key)


def key_to_pem(key: PrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def generate_key(algorithm: KeyAlgorithm) -> PrivateKey:
    if algorithm == "ecdsa-p256":
        return ec.generate_private_key(ec.SECP256R1())
    bits = int(algorithm.removeprefix("rsa-"))
    return rsa.generate_private_key(public_exponent=65537, key_size=bits)


def issue_ca(
    *,
    common_name: str,
    lifetime: timedelta,
    now: datetime,
    backdate: timedelta,
    algorithm: KeyAlgorithm,
) -> Issued:
    """A new self-signed CA. Its common name carries the issue time, so that two CAs of one
    installation are told apart in ``fracgpu certs show`` and in the caBundle."""
    key = generate_key(algorithm)
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, ORGANIZATION),
            x509.NameAttribute(NameOID.COMMON_NAME, f"{common_name} {now:%Y-%m-%dT%H:%M:%SZ}"),
        ]
    )
    public = key.public_key()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - backdate)
        .not_valid_after(now + lifetime)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .sign(key, hashes.SHA256())
    )
    return Issued(cert, key)


def issue_serving(
    ca: Issued,
    *,
    hosts: Sequence[str],
    ips: Sequence[str],
    lifetime: timedelta,
    now: datetime,
    backdate: timedelta,
    algorithm: KeyAlgorithm,
) -> Issued:
    """A serving certificate signed by ``ca``, never outliving it (a chain is only as valid as
    its shortest-lived link)."""
    if not hosts and not ips:
        raise ValueError("a serving certificate needs at least one DNS name or IP address")
    key = generate_key(algorithm)
    sans: list[x509.GeneralName] = [x509.DNSName(h) for h in hosts]
    sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
    builder = _leaf(
        ca,
        key,
        common_name=hosts[0] if hosts else ips[0],
        lifetime=lifetime,
        now=now,
        backdate=backdate,
    )
    cert = (
        builder.add_extension(
            # RSA key exchange is disabled by our TLS policy, but some verifiers still expect
            # keyEncipherment on RSA server certificates.
            _key_usage(key_encipherment=isinstance(key, rsa.RSAPrivateKey)),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .sign(ca.key, hashes.SHA256())
    )
    return Issued(cert, key)


def _leaf(
    ca: Issued,
    key: PrivateKey,
    *,
    common_name: str,
    lifetime: timedelta,
    now: datetime,
    backdate: timedelta,
) -> x509.CertificateBuilder:
    """What every certificate ``ca`` signs for fracgpu has: its name, its validity inside the
    CA's (a chain is only as valid as its shortest-lived link), no CA rights, key identifiers."""
    public = key.public_key()
    return (
        x509.CertificateBuilder()
        .subject_name(
            x509.Name(
                [
                    x509.NameAttribute(NameOID.ORGANIZATION_NAME, ORGANIZATION),
                    x509.NameAttribute(NameOID.COMMON_NAME, common_name[:64]),
                ]
            )
        )
        .issuer_name(ca.cert.subject)
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(max(now - backdate, ca.cert.not_valid_before_utc))
        .not_valid_after(min(now + lifetime, ca.cert.not_valid_after_utc))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()),
            critical=False,
        )
    )


def _key_usage(*, key_encipherment: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=key_encipherment,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=False,
        crl_sign=False,
        encipher_only=False,
        decipher_only=False,
    )


def issue_client(
    ca: Issued,
    *,
    common_name: str,
    lifetime: timedelta,
    now: datetime,
    backdate: timedelta,
    algorithm: KeyAlgorithm,
) -> Issued:
    """A client certificate signed by ``ca`` (clientAuth only, no SANs), never outliving it.

    The scheduler extender's listener accepts a client whose certificate chains to fracgpu's
    CA; OpenSSL also checks the client certificate's purpose, so fracgpu's serving certificate
    (serverAuth only), whose key every replica holds, is not a client certificate there. Only
    certificates issued here are.
    """
    key = generate_key(algorithm)
    cert = (
        _leaf(ca, key, common_name=common_name, lifetime=lifetime, now=now, backdate=backdate)
        .add_extension(_key_usage(key_encipherment=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(ca.key, hashes.SHA256())
    )
    return Issued(cert, key)


def san_sets(cert: x509.Certificate) -> tuple[frozenset[str], frozenset[str]]:
    """The DNS names and (normalised) IP addresses a certificate carries."""
    try:
        ext = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return frozenset(), frozenset()
    return (
        frozenset(ext.get_values_for_type(x509.DNSName)),
        frozenset(str(ip) for ip in ext.get_values_for_type(x509.IPAddress)),
    )


def normalise_ips(ips: Sequence[str]) -> frozenset[str]:
    return frozenset(str(ipaddress.ip_address(ip)) for ip in ips)


def signed_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    """Whether ``ca``'s key made ``cert``'s signature (not just a matching issuer name: every
    fracgpu CA of one installation has a similar name)."""
    if cert.issuer != ca.subject:
        return False
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def key_matches(cert: x509.Certificate, key: PrivateKey) -> bool:
    fmt = serialization.PublicFormat.SubjectPublicKeyInfo
    enc = serialization.Encoding.DER
    return bool(cert.public_key().public_bytes(enc, fmt) == key.public_key().public_bytes(enc, fmt))
