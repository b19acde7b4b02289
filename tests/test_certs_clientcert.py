"""The scheduler's client certificate (certs/clientcert.py): when it is issued again, and what
the keeper stores (against the fake API server: create, then compare-and-swap updates)."""

from __future__ import annotations

import base64
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest

from certs.clientcert import CLIENT_FILES, ClientCertificateKeeper, issue, reissue_reason
from certs.config import CertsConfig
from certs.issuance import issue_ca
from certs.material import CA_CERT, TLS_CERT, TLS_KEY, Material
from certs.rotation import plan
from certs.stores import Files
from testkit.apiserver import FakeApiServer

CONFIG = CertsConfig(mode="secret")
T0 = datetime(2026, 1, 1, tzinfo=UTC)
MATERIAL = plan(None, CONFIG, standalone=False, now=T0).material
ISSUED = issue(MATERIAL, CONFIG, T0, "fracgpu-scheduler")


def _other_ca() -> Material:
    other = issue_ca(
        common_name="another CA",
        lifetime=timedelta(days=365),
        now=T0,
        backdate=timedelta(hours=1),
        algorithm="ecdsa-p256",
    )
    return Material(other, (other.cert,), MATERIAL.serving)


def _rotated_ca(at: datetime) -> Material:
    """The CA renewed at ``at``: the new CA signs, both are trusted."""
    new = issue_ca(
        common_name="fracgpu webhook CA",
        lifetime=timedelta(days=365),
        now=at,
        backdate=CONFIG.backdate,
        algorithm="ecdsa-p256",
    )
    return Material(new, (new.cert, MATERIAL.ca.cert), MATERIAL.serving)


LIFE = CONFIG.serving_lifetime
ROTATED = _rotated_ca(T0 + timedelta(days=1))


@pytest.mark.parametrize(
    ("files", "material", "now", "reason"),
    [
        pytest.param(lambda: None, MATERIAL, T0, "no client certificate stored yet", id="none"),
        pytest.param(lambda: ISSUED, MATERIAL, T0 + timedelta(days=1), None, id="fresh-stays"),
        pytest.param(
            lambda: {k: v for k, v in ISSUED.items() if k != TLS_KEY},
            MATERIAL,
            T0,
            "missing tls.key",
            id="key-missing",
        ),
        pytest.param(
            lambda: {**ISSUED, TLS_KEY: issue(MATERIAL, CONFIG, T0, "x")[TLS_KEY]},
            MATERIAL,
            T0,
            "tls.key does not belong to tls.crt",
            id="key-of-another-certificate",
        ),
        pytest.param(
            lambda: ISSUED, MATERIAL, T0 + LIFE * 0.7, "renewal due", id="two-thirds-of-its-life"
        ),
        pytest.param(lambda: ISSUED, MATERIAL, T0 + LIFE, "not valid now", id="expired"),
        pytest.param(
            lambda: ISSUED, _other_ca(), T0, "signed by no CA in the bundle", id="ca-replaced"
        ),
        pytest.param(
            lambda: {**ISSUED, CA_CERT: b""},
            MATERIAL,
            T0,
            "the trusted CAs changed",
            id="bundle-changed",
        ),
        pytest.param(
            lambda: {**ISSUED, CA_CERT: ROTATED.bundle_pem()},
            ROTATED,
            T0 + timedelta(days=1, minutes=1),
            None,
            id="new-ca-not-yet-propagated-keeps-the-old-signer",
        ),
    ],
)
def test_when_the_client_certificate_is_issued_again(
    files: Callable[[], Files | None], material: Material, now: datetime, reason: str | None
) -> None:
    got = reissue_reason(files(), material, CONFIG, now)
    if reason is None:
        assert got is None
    else:
        assert got is not None and got.startswith(reason), got


def test_it_moves_to_a_new_ca_once_every_replica_trusts_it() -> None:
    at = T0 + timedelta(days=1)
    rotated = _rotated_ca(at)
    files = {**ISSUED, CA_CERT: rotated.bundle_pem()}
    later = at + CONFIG.backdate + CONFIG.ca_propagation
    assert reissue_reason(files, rotated, CONFIG, later) == "moves to the new CA"


async def test_the_keeper_creates_then_renews_the_secret_by_compare_and_swap() -> None:
    clock = [T0]
    async with FakeApiServer(namespaces=("fracgpu",)) as fake, fake.api_client() as api:
        keeper = ClientCertificateKeeper(
            api, CONFIG, "fracgpu-scheduler-client-tls", lambda: MATERIAL, clock=lambda: clock[0]
        )
        assert await keeper.ensure() == "no client certificate stored yet"
        first = fake.get("secrets", "fracgpu-scheduler-client-tls", "fracgpu")
        assert first is not None and set(first["data"]) == set(CLIENT_FILES)
        assert await keeper.ensure() is None  # nothing due: no write
        same = fake.get("secrets", "fracgpu-scheduler-client-tls", "fracgpu")
        assert same is not None
        assert same["metadata"]["resourceVersion"] == first["metadata"]["resourceVersion"]
        clock[0] = T0 + LIFE * 0.7
        reason = await keeper.ensure()
        assert reason is not None and reason.startswith("renewal due")
        renewed = fake.get("secrets", "fracgpu-scheduler-client-tls", "fracgpu")
        assert renewed is not None
        assert renewed["data"][TLS_CERT] != first["data"][TLS_CERT]
        assert base64.b64decode(renewed["data"][CA_CERT]) == MATERIAL.bundle_pem()


async def test_the_keeper_waits_for_the_ca() -> None:
    """Until the serving certificate's source has read its store there is no CA to sign with."""
    async with FakeApiServer(namespaces=("fracgpu",)) as fake, fake.api_client() as api:
        keeper = ClientCertificateKeeper(api, CONFIG, "client", lambda: None)
        assert await keeper.ensure() is None
        assert fake.get("secrets", "client", "fracgpu") is None
