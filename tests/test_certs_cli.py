"""`fracgpu certs …`: standalone on a directory, and in-cluster against the fake API server."""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from certs.cli import add_parser
from certs.issuance import san_sets
from certs.material import Material
from testkit.apiserver import DEFAULT_NAMESPACES, FakeApiServer
from tests.test_certs_inject import webhook_configuration


def run(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="fracgpu")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(list(argv))
    return int(args.run(args))


def test_issue_show_rotate_on_a_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = ["--directory", str(tmp_path / "certs")]
    assert run("certs", "show", *store) == 2
    assert "no certificates yet" in capsys.readouterr().out
    assert run("certs", "issue", *store) == 0
    capsys.readouterr()
    assert run("certs", "show", "--json", *store) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["serving"]["dns_names"] == ["localhost"]
    assert report["serving"]["ip_addresses"] == ["127.0.0.1", "::1"]
    assert report["serving"]["key"] == "ECDSA secp256r1"
    assert report["attention"] == []
    first = report["serving"]["sha256"]

    assert run("certs", "rotate", *store) == 0
    capsys.readouterr()
    assert run("certs", "show", "--json", *store) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["serving"]["sha256"] != first
    assert len(report["trusted_cas"]) == 1

    assert run("certs", "rotate", "--ca", *store) == 0
    assert "after 0:10:00" in capsys.readouterr().out
    assert run("certs", "show", *store) == 0
    text = capsys.readouterr().out
    assert "[1] current signer" in text
    assert "[2] signs the serving cert" in text
    assert "sha256" in text
    assert "expires in 29d" in text


def test_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run("certs", "rotate", "--immediate", "--directory", str(tmp_path)) == 1
    assert "--immediate only applies with --ca" in capsys.readouterr().err
    config = tmp_path / "c.yaml"
    config.write_text("certs:\n  ca_renew_before: P900D\n")
    assert run("certs", "issue", "--config", str(config)) == 1
    assert "must be shorter than certs.ca_lifetime" in capsys.readouterr().err
    assert run("certs", "issue", "--mode", "files") == 1
    assert "cert-manager" in capsys.readouterr().err


NS = "fracgpu"


@pytest.fixture
async def fake() -> AsyncIterator[FakeApiServer]:
    async with FakeApiServer(namespaces=(*DEFAULT_NAMESPACES, NS)) as server:
        yield server


async def test_in_cluster_issue_inject_show(
    fake: FakeApiServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kubeconfig = str(fake.kubeconfig(tmp_path / "kubeconfig"))
    cluster = ["--mode", "secret", "--kubeconfig", kubeconfig]
    fake.put(webhook_configuration("MutatingWebhookConfiguration", "fracgpu-mutate"))
    fake.put(webhook_configuration("ValidatingWebhookConfiguration", "fracgpu-validate"))

    # The CLI runs its own event loop; the fake serves on this one.
    assert await asyncio.to_thread(run, "certs", "issue", *cluster) == 0
    secret = fake.get("secrets", "fracgpu-webhook-tls", NS)
    assert secret is not None
    material = Material.from_files({k: base64.b64decode(v) for k, v in secret["data"].items()})
    assert "fracgpu-webhook.fracgpu.svc" in san_sets(material.serving.cert)[0]
    capsys.readouterr()

    assert await asyncio.to_thread(run, "certs", "show", "--json", *cluster) == 2
    report = json.loads(capsys.readouterr().out)
    states = [w["state"] for w in report["webhook_configurations"]]
    assert states == ["STALE in 2 of 2 webhooks", "STALE in 2 of 2 webhooks"]

    assert await asyncio.to_thread(run, "certs", "inject", *cluster) == 0
    assert "caBundle written into 2 webhook(s)" in capsys.readouterr().out
    obj = fake.get("mutatingwebhookconfigurations", "fracgpu-mutate")
    assert obj is not None
    assert base64.b64decode(obj["webhooks"][0]["clientConfig"]["caBundle"]) == (
        material.bundle_pem()
    )
    assert await asyncio.to_thread(run, "certs", "show", *cluster) == 0
    assert "caBundle current" in capsys.readouterr().out
