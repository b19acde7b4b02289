"""The certificates fracgpu manages, as they are stored (Secret keys = file names).

``ca.crt`` / ``ca.key``   the CA that signs serving certificates now
``ca-bundle.crt``         every CA clients must trust, newest first: the current CA plus older
                          ones that have not expired (the overlap during CA rotation)
``tls.crt`` / ``tls.key`` the serving certificate (the names kubernetes.io/tls Secrets use)

``ServingState`` is what a TLS server needs, whoever issued it (fracgpu or cert-manager).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from certs.issuance import Issued, PrivateKey, key_matches, key_to_pem

CA_CERT = "ca.crt"
CA_KEY = "ca.key"
CA_BUNDLE = "ca-bundle.crt"
TLS_CERT = "tls.crt"
TLS_KEY = "tls.key"
MANAGED_FILES = (CA_CERT, CA_KEY, CA_BUNDLE, TLS_CERT, TLS_KEY)
PRIVATE_FILES = frozenset({CA_KEY, TLS_KEY})


class MaterialError(ValueError):
    """Stored certificates that cannot be used (missing, unparsable or not matching)."""


def certs_to_pem(certs: tuple[x509.Certificate, ...]) -> bytes:
    return b"".join(c.public_bytes(serialization.Encoding.PEM) for c in certs)


def fingerprint(cert: x509.Certificate) -> str:
    """SHA-256 fingerprint as ``openssl x509 -fingerprint -sha256`` prints it."""
    return ":".join(f"{b:02X}" for b in cert.fingerprint(hashes.SHA256()))


def parse_certs(name: str, data: bytes) -> tuple[x509.Certificate, ...]:
    try:
        certs = tuple(x509.load_pem_x509_certificates(data))
    except ValueError as exc:
        raise MaterialError(f"{name}: not PEM certificates ({exc})") from None
    if not certs:
        raise MaterialError(f"{name}: holds no certificate")
    return certs


def parse_key(name: str, data: bytes) -> PrivateKey:
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise MaterialError(f"{name}: not an unencrypted PEM private key ({exc})") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey):
        raise MaterialError(f"{name}: {type(key).__name__} keys are not supported; use EC or RSA")
    return key


@dataclass(frozen=True, slots=True)
class ServingState:
    """What the TLS server serves and what its clients must trust."""

    chain: tuple[x509.Certificate, ...]  # leaf first
    key_pem: bytes
    trusted: tuple[x509.Certificate, ...]  # the caBundle

    @property
    def leaf(self) -> x509.Certificate:
        return self.chain[0]

    def chain_pem(self) -> bytes:
        return certs_to_pem(self.chain)

    def bundle_pem(self) -> bytes:
        return certs_to_pem(self.trusted)

    def digest(self) -> str:
        """Identifies the content, to tell a real change from a re-read of the same files."""
        h = hashlib.sha256(self.chain_pem())
        h.update(self.key_pem)
        h.update(self.bundle_pem())
        return h.hexdigest()

    @classmethod
    def from_pem(
        cls,
        *,
        chain: bytes,
        key: bytes,
        trusted: bytes,
        names: tuple[str, str, str] = (TLS_CERT, TLS_KEY, CA_CERT),
    ) -> ServingState:
        """Parses externally issued files (cert-manager: tls.crt, tls.key, ca.crt); errors
        name them by ``names`` (chain, key, trusted), such as the paths they were read from."""
        chain_name, key_name, trusted_name = names
        certs = parse_certs(chain_name, chain)
        private = parse_key(key_name, key)
        if not key_matches(certs[0], private):
            raise MaterialError(
                f"{key_name} does not belong to the first certificate of {chain_name}; "
                "the files were probably read in the middle of an update"
            )
        return cls(certs, key_to_pem(private), parse_certs(trusted_name, trusted))


@dataclass(frozen=True, slots=True)
class Material:
    """A CA with its key, the trusted CAs and a serving certificate: everything fracgpu manages."""

    ca: Issued
    trusted: tuple[x509.Certificate, ...]
    serving: Issued

    def serving_state(self) -> ServingState:
        return ServingState((self.serving.cert,), self.serving.key_pem(), self.trusted)

    def bundle_pem(self) -> bytes:
        return certs_to_pem(self.trusted)

    def to_files(self) -> dict[str, bytes]:
        return {
            CA_CERT: self.ca.cert_pem(),
            CA_KEY: self.ca.key_pem(),
            CA_BUNDLE: self.bundle_pem(),
            TLS_CERT: self.serving.cert_pem(),
            TLS_KEY: self.serving.key_pem(),
        }

    @classmethod
    def from_files(cls, files: Mapping[str, bytes]) -> Material:
        missing = [name for name in MANAGED_FILES if name not in files]
        if missing:
            raise MaterialError(f"missing {', '.join(missing)}")
        ca_cert = parse_certs(CA_CERT, files[CA_CERT])[0]
        ca_key = parse_key(CA_KEY, files[CA_KEY])
        if not key_matches(ca_cert, ca_key):
            raise MaterialError(f"{CA_KEY} does not belong to {CA_CERT}")
        tls_cert = parse_certs(TLS_CERT, files[TLS_CERT])[0]
        tls_key = parse_key(TLS_KEY, files[TLS_KEY])
        if not key_matches(tls_cert, tls_key):
            raise MaterialError(f"{TLS_KEY} does not belong to {TLS_CERT}")
        trusted = parse_certs(CA_BUNDLE, files[CA_BUNDLE])
        if ca_cert not in trusted:
            raise MaterialError(f"{CA_BUNDLE} does not contain {CA_CERT}")
        return cls(Issued(ca_cert, ca_key), trusted, Issued(tls_cert, tls_key))
