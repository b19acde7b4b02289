"""Issued certificates: SANs, usages, validity, keys."""

from __future__ import annotations

import ipaddress
from datetime import UTC, datetime, timedelta

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID

from certs.config import CertsConfig
from certs.issuance import issue_ca, issue_serving, key_matches, signed_by
from certs.rotation import plan

NOW = datetime(2026, 11, 22, 12, 0, tzinfo=UTC)


def test_serving_certificate_names_every_service_dns_name_and_extras() -> None:
    config = CertsConfig(
        service="gpu", namespace="infra", hosts=["gpu.example.com"], ips=["10.0.0.7"]
    )
    material = plan(None, config, standalone=False, now=NOW).material
    san = material.serving.cert.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    assert san.value.get_values_for_type(x509.DNSName) == [
        "gpu",
        "gpu.infra",
        "gpu.infra.svc",
        "gpu.infra.svc.cluster.local",
        "gpu.example.com",
    ]
    assert san.value.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("10.0.0.7")]


def test_standalone_names_loopback_only() -> None:
    material = plan(None, CertsConfig(), standalone=True, now=NOW).material
    san = material.serving.cert.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    assert san.value.get_values_for_type(x509.DNSName) == ["localhost"]
    assert san.value.get_values_for_type(x509.IPAddress) == [
        ipaddress.ip_address("127.0.0.1"),
        ipaddress.ip_address("::1"),
    ]


def test_usages_and_constraints() -> None:
    material = plan(None, CertsConfig(), standalone=False, now=NOW).material
    ca, serving = material.ca.cert, material.serving.cert
    ca_basic = ca.extensions.get_extension_for_class(x509.BasicConstraints)
    assert ca_basic.critical
    assert ca_basic.value.ca
    assert ca_basic.value.path_length == 0
    assert ca.extensions.get_extension_for_class(x509.KeyUsage).value.key_cert_sign
    basic = serving.extensions.get_extension_for_class(x509.BasicConstraints)
    assert basic.critical
    assert not basic.value.ca
    usage = serving.extensions.get_extension_for_class(x509.KeyUsage).value
    assert usage.digital_signature
    assert not usage.key_cert_sign
    eku = serving.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.SERVER_AUTH]
    assert signed_by(serving, ca)
    assert not signed_by(ca, serving)


def test_validity_is_backdated_and_follows_configured_lifetimes() -> None:
    config = CertsConfig(
        ca_lifetime=timedelta(days=100),
        ca_renew_before=timedelta(days=20),
        serving_lifetime=timedelta(days=7),
        backdate=timedelta(minutes=5),
    )
    material = plan(None, config, standalone=False, now=NOW).material
    for issued, lifetime in ((material.ca, 100), (material.serving, 7)):
        assert issued.cert.not_valid_before_utc == NOW - timedelta(minutes=5)
        assert issued.cert.not_valid_after_utc == NOW + timedelta(days=lifetime)


def test_serving_certificate_never_outlives_its_ca() -> None:
    ca = issue_ca(
        common_name="t",
        lifetime=timedelta(days=2),
        now=NOW,
        backdate=timedelta(hours=1),
        algorithm="ecdsa-p256",
    )
    serving = issue_serving(
        ca,
        hosts=["x"],
        ips=[],
        lifetime=timedelta(days=30),
        now=NOW,
        backdate=timedelta(hours=1),
        algorithm="ecdsa-p256",
    )
    assert serving.cert.not_valid_after_utc == ca.cert.not_valid_after_utc


@pytest.mark.parametrize(
    ("algorithm", "kind", "size"),
    [("ecdsa-p256", ec.EllipticCurvePrivateKey, 256), ("rsa-2048", rsa.RSAPrivateKey, 2048)],
    ids=["ECDSA P-256", "RSA 2048"],
)
def test_key_algorithms(algorithm: str, kind: type, size: int) -> None:
    config = CertsConfig.model_validate({"key_algorithm": algorithm})
    material = plan(None, config, standalone=False, now=NOW).material
    for issued in (material.ca, material.serving):
        assert isinstance(issued.key, kind)
        assert issued.key.key_size == size
        assert key_matches(issued.cert, issued.key)
    assert not key_matches(material.ca.cert, material.serving.key)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"ips": ["not-an-ip"]}, "not an IP address"),
        ({"ca_renew_before": "P400D"}, "must be shorter than certs.ca_lifetime"),
        ({"ca_propagation": "P90D"}, "must be shorter than certs.ca_renew_before"),
        ({"serving_lifetime": "P900D"}, "must not exceed certs.ca_lifetime"),
        ({"serving_renew_at": 1.0}, "less than 1"),
        ({"unknown": 1}, "Extra inputs are not permitted"),
    ],
    ids=[
        "an IP that is not one",
        "CA renewal longer than its life",
        "propagation longer than CA renewal",
        "serving outlives the CA",
        "renew at 100%",
        "an unknown field",
    ],
)
def test_configuration_errors_name_the_rule(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CertsConfig.model_validate(fields)
