"""The scheduler's client certificate (certs/clientcert.py): when it is issued again, and what
the keeper stores (against the fake API server: create, then compare-and-swap updates)."""

from __future__ import annotations

import base64
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest

from certs.clientcert import (
    CA_STAMP_ANNOTATION,
    CLIENT_FILES,
    ClientCertificateKeeper,
    bundle_stamp,
    deployment_restarter,
    issue,
    reissue_reason,
)
from certs.config import CertsConfig
from certs.issuance import issue_ca
from certs.material import CA_CERT, TLS_CERT, TLS_KEY, Material
from certs.rotation import plan
from certs.stores import Files
from core.kube import KubeUnavailable
from testkit.apiserver import FakeApiServer
from testkit.kinds import DEPLOYMENT

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


SCHEDULER = {
    "apiVersion": "apps/v1",
    "kind": "Deployment",
    "metadata": {"name": "fracgpu-scheduler", "namespace": "fracgpu"},
    "spec": {"template": {"metadata": {"labels": {"app": "s"}}, "spec": {"containers": []}}},
}


def _stamp_of(fake: FakeApiServer) -> str | None:
    found = fake.get("deployments", "fracgpu-scheduler", "fracgpu")
    assert found is not None
    annotations = found["spec"]["template"]["metadata"].get("annotations") or {}
    stamp: str | None = annotations.get(CA_STAMP_ANNOTATION)
    return stamp


async def test_a_new_ca_in_the_bundle_restarts_the_scheduler_once_and_first_issue_does_not() -> (
    None
):
    """kube-scheduler reads caFile only at start: when the keeper writes a ca.crt that differs
    from the stored one, it stamps the bundle on the scheduler's pod template (a rollout);
    the first issue, and a renewal under the same CAs, restart nothing."""
    material = [MATERIAL]
    clock = [T0]
    async with FakeApiServer(namespaces=("fracgpu",)) as fake, fake.api_client() as api:
        fake.register(DEPLOYMENT)
        fake.put(SCHEDULER)
        keeper = ClientCertificateKeeper(
            api,
            CONFIG,
            "fracgpu-scheduler-client-tls",
            lambda: material[0],
            clock=lambda: clock[0],
            restart=deployment_restarter(api, "fracgpu", "fracgpu-scheduler"),
        )
        assert await keeper.ensure() == "no client certificate stored yet"
        assert _stamp_of(fake) is None
        clock[0] = T0 + LIFE * 0.7
        assert (await keeper.ensure() or "").startswith("renewal due")
        assert _stamp_of(fake) is None
        clock[0] = T0 + LIFE * 0.7 + timedelta(hours=1)
        material[0] = _rotated_ca(clock[0])
        assert await keeper.ensure() == "the trusted CAs changed"
        assert _stamp_of(fake) == bundle_stamp(material[0].bundle_pem())
        assert await keeper.ensure() is None
        assert _stamp_of(fake) == bundle_stamp(material[0].bundle_pem())


AFTER_ROTATION = T0 + timedelta(days=1, hours=1)


async def test_a_failed_restart_is_tried_again_at_the_next_check() -> None:
    calls: list[str] = []

    async def flaky(stamp: str) -> None:
        calls.append(stamp)
        if len(calls) == 1:
            raise KubeUnavailable("the API server did not answer")

    async with FakeApiServer(namespaces=("fracgpu",)) as fake, fake.api_client() as api:
        keeper = ClientCertificateKeeper(
            api, CONFIG, "client", lambda: material, clock=lambda: AFTER_ROTATION, restart=flaky
        )
        material = MATERIAL
        await keeper.ensure()
        material = ROTATED
        with pytest.raises(KubeUnavailable):
            await keeper.ensure()
        assert keeper.restart_due is not None
        assert await keeper.ensure() is None
        assert keeper.restart_due is None
        assert calls == [bundle_stamp(ROTATED.bundle_pem())] * 2


async def test_no_scheduler_deployment_is_logged_not_retried(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with FakeApiServer(namespaces=("fracgpu",)) as fake, fake.api_client() as api:
        fake.register(DEPLOYMENT)
        restart = deployment_restarter(api, "fracgpu", "fracgpu-scheduler")
        await restart("sha256:x")
    assert "Deployment was not found" in caplog.text
