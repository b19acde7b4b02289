"""The rotation plan over a certificate's whole life, driven by a simulated clock."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest

from certs.config import CertsConfig
from certs.issuance import signed_by
from certs.material import Material
from certs.rotation import Request, next_due, plan

T0 = datetime(2026, 1, 1, tzinfo=UTC)
CONFIG = CertsConfig(
    ca_lifetime=timedelta(days=365),
    ca_renew_before=timedelta(days=60),
    ca_propagation=timedelta(minutes=10),
    serving_lifetime=timedelta(days=30),
    serving_renew_at=2 / 3,
    backdate=timedelta(hours=1),
)


def step(
    current: Material | None, now: datetime, **request: bool
) -> tuple[Material, tuple[str, ...]]:
    result = plan(current, CONFIG, standalone=False, now=now, request=Request(**request))
    return result.material, result.reasons


def verifies(material: Material, served: Material) -> bool:
    """Whether a client holding ``material``'s bundle accepts what ``served`` serves."""
    return any(signed_by(served.serving.cert, ca) for ca in material.trusted)


def test_nothing_changes_before_the_renew_point() -> None:
    first, reasons = step(None, T0)
    assert reasons == ("no certificates stored yet",)
    again, reasons = step(first, T0 + timedelta(days=19))
    assert reasons == ()
    assert again == first


def test_serving_certificate_is_renewed_at_its_renew_point() -> None:
    first, _ = step(None, T0)
    renewed, reasons = step(first, T0 + timedelta(days=20, hours=1))
    assert reasons
    assert "serving certificate renewal due" in reasons[0]
    assert renewed.ca == first.ca
    assert renewed.serving != first.serving
    assert renewed.serving.cert.not_valid_after_utc == T0 + timedelta(days=50, hours=1)


def test_two_years_of_rotation_never_leave_a_client_without_trust() -> None:
    """Every 8 hours for 700 days: the bundle injected after each step verifies both what was served
    before and what is served after it (the API server may see either), nothing served ever
    expires, and the bundle never grows beyond two CAs."""
    material, _ = step(None, T0)
    now = T0
    cas_seen = {material.ca.cert.serial_number}
    serving_seen = {material.serving.cert.serial_number}
    while now < T0 + timedelta(days=700):
        now += timedelta(hours=8)
        new, _ = step(material, now)
        assert verifies(new, material), f"{now}: the new bundle rejects the old certificate"
        if new.serving != material.serving:
            # Served only once its CA is in every bundle that was injected before.
            assert verifies(material, new), f"{now}: served a certificate of an unpropagated CA"
        assert new.serving.cert.not_valid_after_utc > now
        assert len(new.trusted) <= 2
        cas_seen.add(new.ca.cert.serial_number)
        serving_seen.add(new.serving.cert.serial_number)
        material = new
    assert len(cas_seen) == 3  # renewed at day 305 and day 610
    assert len(serving_seen) >= 700 // 20


def _serving_renewed_shortly_before_ca_renewal() -> tuple[Material, datetime]:
    first, _ = step(None, T0)
    renew_at = first.ca.cert.not_valid_after_utc - CONFIG.ca_renew_before
    current, _ = step(first, renew_at - timedelta(days=1), serving=True)
    return current, renew_at


def test_ca_rotation_overlaps_then_moves_the_serving_certificate() -> None:
    first, renew_at = _serving_renewed_shortly_before_ca_renewal()
    rotated, reasons = step(first, renew_at)
    assert any("CA renewal due" in r for r in reasons)
    assert rotated.trusted == (rotated.ca.cert, first.ca.cert)
    # Not yet: the serving certificate waits until the new CA has propagated.
    same, reasons = step(rotated, renew_at + timedelta(minutes=9))
    assert reasons == ()
    assert same.serving == first.serving
    moved, reasons = step(rotated, renew_at + timedelta(minutes=11))
    assert reasons == ("serving certificate moves to the new CA",)
    assert signed_by(moved.serving.cert, rotated.ca.cert)
    assert moved.trusted == rotated.trusted
    # The old CA leaves the bundle when it expires.
    later, reasons = step(moved, first.ca.cert.not_valid_after_utc + timedelta(seconds=1))
    assert later.trusted == (rotated.ca.cert,)
    assert "expired CAs dropped from the bundle" in reasons


def test_requested_rotations() -> None:
    first, _ = step(None, T0)
    serving, reasons = step(first, T0 + timedelta(days=1), serving=True)
    assert reasons == ("serving certificate rotation requested",)
    assert serving.ca == first.ca
    assert serving.serving != first.serving
    ca, reasons = step(first, T0 + timedelta(days=1), ca=True)
    assert reasons == ("CA rotation requested",)
    assert ca.trusted == (ca.ca.cert, first.ca.cert)
    assert ca.serving == first.serving
    # A leaked key: replace everything at once, trusting only the new CA.
    now_ca, _ = step(first, T0 + timedelta(days=1), ca=True, immediate=True)
    assert now_ca.trusted == (now_ca.ca.cert,)
    assert signed_by(now_ca.serving.cert, now_ca.ca.cert)


def test_expired_serving_certificate_at_ca_rotation_is_signed_by_the_old_ca() -> None:
    first, _ = step(None, T0)
    renew_at = first.ca.cert.not_valid_after_utc - CONFIG.ca_renew_before
    rotated, _ = step(first, renew_at)  # the serving certificate expired long ago
    assert rotated.ca != first.ca
    assert signed_by(rotated.serving.cert, first.ca.cert)


def test_unusable_serving_certificates_are_replaced_at_once() -> None:
    first, _ = step(None, T0)
    # Configuration gained a host name.
    wider = CONFIG.model_copy(update={"hosts": ["webhook.example.com"]})
    result = plan(first, wider, standalone=False, now=T0 + timedelta(days=1))
    assert result.changed
    assert "configuration wants" in result.reasons[0]
    # The process was down past the serving certificate's expiry.
    late, reasons = step(first, T0 + timedelta(days=31))
    assert "serving certificate expires" in reasons[0]
    assert late.ca == first.ca
    # ... or past the CA's: a fresh start.
    fresh, reasons = step(first, T0 + timedelta(days=400))
    assert reasons[0].startswith("the CA expired")
    assert fresh.ca != first.ca
    assert fresh.trusted == (fresh.ca.cert,)


def test_next_due_is_the_earliest_renew_point() -> None:
    first, _ = step(None, T0)
    start = first.serving.cert.not_valid_before_utc
    expected = start + (first.serving.cert.not_valid_after_utc - start) * CONFIG.serving_renew_at
    assert next_due(first, CONFIG, T0) == expected
    current, renew_at = _serving_renewed_shortly_before_ca_renewal()
    rotated, _ = step(current, renew_at)
    assert next_due(rotated, CONFIG, renew_at) == renew_at + CONFIG.ca_propagation


def test_changing_the_key_algorithm_rotates_with_overlap() -> None:
    first, _ = step(None, T0)
    rsa_config = CONFIG.model_copy(update={"key_algorithm": "rsa-2048"})
    result = plan(first, rsa_config, standalone=False, now=T0 + timedelta(days=1))
    assert result.reasons == ("CA key algorithm differs from certs.key_algorithm=rsa-2048",)
    assert result.material.trusted == (result.material.ca.cert, first.ca.cert)
    later = plan(result.material, rsa_config, standalone=False, now=T0 + timedelta(days=1, hours=1))
    assert later.reasons == ("serving certificate moves to the new CA",)
    assert later.material.serving.key.key_size == 2048


def _ca_from_a_clock_ahead() -> Material:
    return step(None, T0 + timedelta(hours=2))[0]


def _serving_from_a_clock_ahead() -> Material:
    first, _ = step(None, T0 - timedelta(days=5))
    return step(first, T0 + timedelta(hours=2), serving=True)[0]


def _serving_in_its_renewal_window() -> Material:
    return step(None, T0 - timedelta(days=21))[0]


def _ca_in_its_renewal_window() -> Material:
    return step(None, T0 - timedelta(days=306))[0]


@pytest.mark.parametrize(
    ("stored", "reason", "same_ca"),
    [
        pytest.param(_ca_from_a_clock_ahead, "the CA is not valid until", False, id="ca-not-yet"),
        pytest.param(
            _serving_from_a_clock_ahead,
            "the serving certificate is not valid until",
            True,
            id="serving-not-yet",
        ),
        pytest.param(
            _serving_in_its_renewal_window,
            "serving certificate renewal due",
            True,
            id="serving-renewal-window",
        ),
        pytest.param(_ca_in_its_renewal_window, "CA renewal due", False, id="ca-renewal-window"),
    ],
)
def test_what_cannot_serve_now_or_soon_is_reissued_with_the_reason(
    stored: Callable[[], Material], reason: str, same_ca: bool
) -> None:
    current = stored()
    renewed, reasons = step(current, T0)
    serving = renewed.serving.cert
    assert reason in reasons[0]
    assert serving.not_valid_before_utc <= T0 < serving.not_valid_after_utc
    assert verifies(renewed, renewed)
    assert (renewed.ca == current.ca) == same_ca


def test_the_not_yet_valid_reason_says_by_how_much_and_what_to_check() -> None:
    _, reasons = step(_serving_from_a_clock_ahead(), T0)
    assert reasons[0] == (
        "the serving certificate is not valid until 2026-01-01T01:00:00Z, 1:00:00 after this "
        "replica's clock (2026-01-01T00:00:00Z): it was issued by a clock running ahead by "
        "more than certs.backdate, or this clock was set back; every TLS handshake would "
        "fail, so it is re-issued now (check NTP on the nodes)"
    )
