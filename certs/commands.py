"""``fracgpu certs``: look at, issue, rotate and inject the webhook's certificates.

Works on the same store the server uses: a directory (standalone, the default), the Secret
(``--mode secret``, in-cluster or through ``--kubeconfig``) or the mounted files (``--mode
files``, read-only: cert-manager renews those). Settings come from ``--config`` (a YAML or JSON
file holding CertsConfig fields, at the top level or under ``certs:``) and flags override them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from collections.abc import AsyncIterator
from datetime import datetime, timedelta
from typing import Any

import yaml
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from pydantic import ValidationError

from certs.config import CertsConfig
from certs.inject import CaBundleInjector, summary, targets, with_bundle
from certs.issuance import san_sets, signed_by
from certs.material import Material, MaterialError, ServingState, fingerprint
from certs.rotation import Request, ca_renew_point, serving_renew_point
from certs.secretstore import SecretStore
from certs.sources import FileSource, ManagedSource, utcnow
from certs.stores import CertificateStore, DirectoryStore
from core.kube import Api, KubeConfigError, KubeError, call_json, kube_client

EXIT_OK, EXIT_ERROR, EXIT_ATTENTION = 0, 1, 2


def load_config(args: argparse.Namespace) -> CertsConfig:
    data: dict[str, Any] = {}
    if args.config is not None:
        document = yaml.safe_load(args.config.read_text()) or {}
        if not isinstance(document, dict):
            raise ValueError(f"{args.config}: expected a mapping of certs settings")
        section = document.get("certs", document)
        data = dict(section) if isinstance(section, dict) else {}
    for field in ("mode", "directory", "namespace", "service", "secret_name"):
        value = getattr(args, field, None)
        if value is not None:
            data[field] = value
    return CertsConfig.model_validate(data)


def _standalone(args: argparse.Namespace, config: CertsConfig) -> bool:
    return config.mode == "directory" if args.standalone is None else bool(args.standalone)


def _needs_cluster(config: CertsConfig, args: argparse.Namespace) -> bool:
    return config.mode == "secret" or args.kubeconfig is not None


@contextlib.asynccontextmanager
async def _cluster(config: CertsConfig, args: argparse.Namespace) -> AsyncIterator[Any]:
    if not _needs_cluster(config, args):
        yield None
        return
    async with kube_client(args.kubeconfig, args.context) as api:
        yield api


def _store(config: CertsConfig, api: Api) -> CertificateStore:
    if config.mode == "secret":
        return SecretStore(api, config.namespace, config.secret_name)
    return DirectoryStore(config.directory)


def _main(args: argparse.Namespace, body: Any) -> int:
    try:
        config = load_config(args)
        return int(asyncio.run(body(args, config)))
    except ValidationError as exc:
        print(f"fracgpu certs: invalid settings:\n{exc}", file=sys.stderr)
    except (OSError, ValueError, KubeConfigError, KubeError, MaterialError) as exc:
        print(f"fracgpu certs: {exc}", file=sys.stderr)
    return EXIT_ERROR


# --- show -------------------------------------------------------------------------------


def _run_show(args: argparse.Namespace) -> int:
    return _main(args, _show)


async def _show(args: argparse.Namespace, config: CertsConfig) -> int:
    now = utcnow()
    async with _cluster(config, args) as api:
        material: Material | None = None
        if config.mode == "files":
            state = await FileSource(config).refresh()
            where = f"files {config.cert_file}, {config.key_file}, {config.ca_file}"
        else:
            store = _store(config, api)
            files, _ = await store.load()
            where = store.description
            if files is None:
                print(f"{where}: no certificates yet (`fracgpu certs issue` creates them)")
                return EXIT_ATTENTION
            material = Material.from_files(files)
            state = material.serving_state()
        injected = await _injection_status(api, config, state) if api is not None else []
    report = _report(
        state, material=material, config=config, now=now, where=where, injected=injected
    )
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        _print_report(report)
    return EXIT_ATTENTION if report["attention"] else EXIT_OK


def _describe(cert: x509.Certificate, now: datetime) -> dict[str, Any]:
    hosts, ips = san_sets(cert)
    key = cert.public_key()
    if isinstance(key, ec.EllipticCurvePublicKey):
        key_text = f"ECDSA {key.curve.name}"
    elif isinstance(key, rsa.RSAPublicKey):
        key_text = f"RSA {key.key_size}"
    else:
        key_text = type(key).__name__
    return {
        "subject": cert.subject.rfc4514_string(),
        "issuer": cert.issuer.rfc4514_string(),
        "dns_names": sorted(hosts),
        "ip_addresses": sorted(ips),
        "not_before": cert.not_valid_before_utc.isoformat(),
        "not_after": cert.not_valid_after_utc.isoformat(),
        "expires_in": _span(cert.not_valid_after_utc - now),
        "serial": f"{cert.serial_number:X}",
        "sha256": fingerprint(cert),
        "key": key_text,
    }


def _span(delta: timedelta) -> str:
    seconds = int(delta.total_seconds())
    sign = "-" if seconds < 0 else ""
    seconds = abs(seconds)
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes = rest // 60
    if days:
        return f"{sign}{days}d{hours}h"
    return f"{sign}{hours}h{minutes}m"


def _report(
    state: ServingState,
    *,
    material: Material | None,
    config: CertsConfig,
    now: datetime,
    where: str,
    injected: list[dict[str, Any]],
) -> dict[str, Any]:
    attention: list[str] = []
    serving = _describe(state.leaf, now)
    leaf = state.leaf
    if leaf.not_valid_after_utc <= now:
        attention.append("the serving certificate has EXPIRED: see docs/certificates.md, 'Paged'")
    cas = []
    for ca in state.trusted:
        entry = _describe(ca, now)
        entry["signs_serving"] = signed_by(leaf, ca)
        entry["current_signer"] = material is not None and ca == material.ca.cert
        cas.append(entry)
        if ca.not_valid_after_utc <= now:
            attention.append(f"trusted CA {entry['sha256'][:23]} has expired")
    if not any(c["signs_serving"] for c in cas):
        attention.append("no CA in the bundle signed the serving certificate")
    if material is not None:
        renew = serving_renew_point(material.serving, config)
        serving["renewal_due"] = renew.isoformat()
        ca_renew = ca_renew_point(material.ca, config)
        if now > renew + config.check_interval * 4:
            attention.append(
                f"serving certificate renewal was due at {renew.isoformat()} and has not "
                "happened: is the webhook running, and can it write its store?"
            )
        if now > ca_renew + config.check_interval * 4:
            attention.append(f"CA renewal was due at {ca_renew.isoformat()} and has not happened")
        cas_info = {"ca_renewal_due": ca_renew.isoformat()}
    else:
        cas_info = {"ca_renewal_due": "by the external issuer (cert-manager)"}
    for item in injected:
        if item["state"] != "current":
            attention.append(f"{item['target']}: caBundle {item['state']}")
    return {
        "store": where,
        "serving": serving,
        "trusted_cas": cas,
        **cas_info,
        "webhook_configurations": injected,
        "attention": attention,
    }


def _print_report(report: dict[str, Any]) -> None:
    print(f"Store: {report['store']}")
    print("Serving certificate")
    _print_cert(report["serving"])
    print(f"Trusted CAs (the caBundle, newest first; CA renewal: {report['ca_renewal_due']})")
    for i, ca in enumerate(report["trusted_cas"], 1):
        tags = [t for t, on in (("signs the serving cert", ca["signs_serving"]),) if on]
        if ca["current_signer"]:
            tags.append("current signer")
        print(f"  [{i}] {', '.join(tags) if tags else 'kept for overlap'}")
        _print_cert(ca, indent="      ")
    if report["webhook_configurations"]:
        print("Webhook configurations")
        for item in report["webhook_configurations"]:
            print(f"  {item['target']}: caBundle {item['state']}")
    for line in report["attention"]:
        print(f"ATTENTION: {line}")


def _print_cert(cert: dict[str, Any], indent: str = "  ") -> None:
    rows = [
        ("subject", cert["subject"]),
        ("issuer", cert["issuer"]),
        ("DNS names", ", ".join(cert["dns_names"]) or "-"),
        ("IP addresses", ", ".join(cert["ip_addresses"]) or "-"),
        ("valid", f"{cert['not_before']} to {cert['not_after']} (expires in {cert['expires_in']})"),
    ]
    if "renewal_due" in cert:
        rows.append(("renewal due", cert["renewal_due"]))
    rows += [("serial", cert["serial"]), ("sha256", cert["sha256"]), ("key", cert["key"])]
    for label, value in rows:
        print(f"{indent}{label:<13}{value}")


async def _injection_status(
    api: Api, config: CertsConfig, state: ServingState
) -> list[dict[str, Any]]:
    result = []
    for target in targets(config):
        try:
            obj = await call_json(api, "GET", target.resource.path(name=target.name))
        except KubeError as err:
            if err.status != 404:
                raise
            result.append({"target": str(target), "state": "absent (configuration not found)"})
            continue
        _, stale = with_bundle(obj, state.bundle_pem())
        total = len(obj.get("webhooks") or [])
        text = "current" if not stale else f"STALE in {stale} of {total} webhooks"
        result.append({"target": str(target), "state": text})
    return result


# --- issue / rotate -----------------------------------------------------------------------


def _run_issue(args: argparse.Namespace) -> int:
    return _main(args, _issue_or_rotate)


def _run_rotate(args: argparse.Namespace) -> int:
    if args.immediate and not args.ca:
        print("fracgpu certs rotate: --immediate only applies with --ca", file=sys.stderr)
        return EXIT_ERROR
    return _main(args, _issue_or_rotate)


async def _issue_or_rotate(args: argparse.Namespace, config: CertsConfig) -> int:
    if config.mode == "files":
        print(
            "fracgpu certs: in files mode the certificates come from cert-manager; renew them "
            "there (cmctl renew <certificate>), fracgpu reloads the mounted files",
            file=sys.stderr,
        )
        return EXIT_ERROR
    request = None
    if args.certs_command == "rotate":
        request = Request(serving=not args.ca, ca=args.ca, immediate=args.immediate)
    async with _cluster(config, args) as api:
        store = _store(config, api)
        source = ManagedSource(store, config, standalone=_standalone(args, config))
        material = await source.ensure(request)
    print(f"{store.description}:")
    print(f"  serving certificate sha256 {fingerprint(material.serving.cert)}")
    print(f"    valid until {material.serving.cert.not_valid_after_utc.isoformat()}")
    for ca in material.trusted:
        print(f"  trusted CA sha256 {fingerprint(ca)} until {ca.not_valid_after_utc.isoformat()}")
    if args.certs_command == "rotate" and args.ca and not args.immediate:
        print(
            f"  new CA added to the bundle; running webhooks inject it and move the serving "
            f"certificate to it after {config.ca_propagation}"
        )
    return EXIT_OK


# --- inject -------------------------------------------------------------------------------


def _run_inject(args: argparse.Namespace) -> int:
    return _main(args, _inject)


async def _inject(args: argparse.Namespace, config: CertsConfig) -> int:
    async with kube_client(args.kubeconfig, args.context) as api:
        if config.mode == "files":
            bundle = (await FileSource(config).refresh()).bundle_pem()
        else:
            files, _ = await _store(config, api).load()
            if files is None:
                print(
                    "fracgpu certs inject: no certificates stored yet; run `fracgpu certs issue`",
                    file=sys.stderr,
                )
                return EXIT_ERROR
            bundle = Material.from_files(files).bundle_pem()
        outcomes = await CaBundleInjector(api, config).inject(bundle)
    for line in summary(outcomes):
        print(line)
    return EXIT_OK
