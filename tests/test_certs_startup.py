"""What a replica does with certificates it cannot serve, at start and while serving: re-issue
what it manages (a certificate from a clock running ahead), and stop with one line that names
the file and the fix when it cannot (files it cannot read or parse)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest

from certs.config import CertsConfig
from certs.material import Material
from certs.rotation import plan
from certs.serving import ServingError, open_serving
from certs.sources import utcnow
from fracgpu.cli import main
from tests.test_certs_files import files_config, issue, publish

AHEAD = timedelta(hours=2)  # more than the 1 h backdate


def renewal_reasons(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        reason
        for record in caplog.records
        if record.getMessage() == "certificates renewed"
        for reason in getattr(record, "reasons", [])
    ]


async def test_at_start_a_certificate_from_a_clock_ahead_is_reissued(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = CertsConfig(directory=tmp_path)
    ahead = await open_serving(config, standalone=True, clock=lambda: utcnow() + AHEAD)
    await ahead.close()
    caplog.clear()
    caplog.set_level(logging.INFO)
    certs = await open_serving(config, standalone=True)
    await certs.close()
    assert certs.ready()
    assert any("the CA is not valid until" in r for r in renewal_reasons(caplog))


async def test_while_serving_a_clock_set_back_gets_a_certificate_valid_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    skew = [AHEAD]
    certs = await open_serving(
        CertsConfig(directory=tmp_path), standalone=True, clock=lambda: utcnow() + skew[0]
    )
    not_ready_before = not certs.ready()
    caplog.set_level(logging.INFO)
    skew[0] = timedelta(0)  # NTP steps the clock back
    changed = await certs.refresh()  # what the refresh loop runs every check_interval
    await certs.close()
    assert not_ready_before
    assert changed
    assert certs.ready()
    assert any("is not valid until" in r for r in renewal_reasons(caplog))


def _write(name: str, data: bytes | None) -> Callable[[Path, Material], Path]:
    """Publishes good files, then replaces ``name`` by ``data`` (None: a directory)."""

    def prepare(mount: Path, material: Material) -> Path:
        publish(mount, material, 1)
        path = mount / name
        path.unlink()
        if data is None:
            path.mkdir()
        else:
            path.write_bytes(data)
        return path

    return prepare


def _missing(name: str) -> Callable[[Path, Material], Path]:
    def prepare(mount: Path, material: Material) -> Path:
        publish(mount, material, 1)
        (mount / name).unlink()
        return mount / name

    return prepare


def _key_of_another(mount: Path, material: Material) -> Path:
    publish(mount, material, 1)
    other = plan(None, CertsConfig(), standalone=True, now=utcnow()).material
    (mount / "tls.key").unlink()
    (mount / "tls.key").write_bytes(other.serving.key_pem())
    return mount / "tls.key"


@pytest.mark.parametrize(
    ("prepare", "problem", "fix"),
    [
        pytest.param(_missing("tls.key"), "cannot read it", "certs.key_file", id="key-missing"),
        pytest.param(
            _write("tls.crt", None), "cannot read it", "certs.cert_file", id="cert-a-directory"
        ),
        pytest.param(
            _write("tls.key", b"-----BEGIN PRIVATE KEY-----\nnot base64\n"),
            "not an unencrypted PEM private key",
            "re-issue the Secret",
            id="key-malformed",
        ),
        pytest.param(
            _write("tls.crt", b"garbage"), "not PEM certificates", "cmctl renew", id="cert-garbage"
        ),
        pytest.param(_write("ca.crt", b""), "not PEM certificates", "certs.ca_file", id="ca-empty"),
        pytest.param(_key_of_another, "does not belong", "certs.key_file", id="key-mismatch"),
    ],
)
async def test_unusable_mounted_files_stop_the_start_with_one_line_naming_the_path(
    tmp_path: Path,
    prepare: Callable[[Path, Material], Path],
    problem: str,
    fix: str,
) -> None:
    path = prepare(tmp_path, issue([]))
    with pytest.raises(ServingError) as raised:
        await open_serving(files_config(tmp_path), standalone=False)
    message = str(raised.value)
    assert str(path) in message
    assert problem in message
    assert fix in message
    assert "\n" not in message


async def test_an_unusable_certificate_directory_names_the_setting(tmp_path: Path) -> None:
    not_a_directory = tmp_path / "certs"
    not_a_directory.write_text("")
    with pytest.raises(ServingError) as raised:
        await open_serving(CertsConfig(directory=not_a_directory), standalone=True)
    assert str(raised.value).startswith(f"certs.directory {not_a_directory}: ")


def test_serve_ends_with_one_log_line_and_no_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    not_a_directory = tmp_path / "certs"
    not_a_directory.write_text("")
    config = tmp_path / "config.yaml"
    config.write_text(f"certs:\n  directory: {not_a_directory}\n")
    status = main(
        ["--log-format", "json", "serve", "--standalone", "--port", "0", "--config", str(config)]
    )
    lines = capsys.readouterr().err.splitlines()
    assert status == 2
    assert len(lines) == 1
    assert str(not_a_directory) in json.loads(lines[0])["error"]
