"""``fracgpu serve``: the admission server with everything it keeps running beside it.

Beside the HTTPS listener run: the certificate keeper (reload, rotation, caBundle injection),
the Node watch that keeps the GPU inventory current, and the quota service. The server is
ready (``/readyz``) only once the inventory has synced, so a new replica never sizes pods
against an empty inventory.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from certs.clientcert import ClientCertificateKeeper, deployment_restarter
from certs.config import CertsConfig
from certs.material import CA_BUNDLE
from certs.serving import ServingCertificates, ServingError, open_serving
from certs.sources import ManagedSource
from core.informer import Informers
from core.kube import Api, kube_client
from extender.metrics import ExtenderMetrics
from extender.service import ExtenderConfig, ExtenderService
from quota.config import QuotaConfig
from quota.forward import DECIDE_PATH
from quota.service import QuotaService, open_quota
from webhook.claims import SliceModels
from webhook.claimstore import TemplateStore, slice_informer
from webhook.config import AdmissionConfig, ConfigError, ServerConfig, describe, load_yaml
from webhook.inventory import Inventory
from webhook.metrics import AdmissionMetrics
from webhook.mode import ModeError
from webhook.mode import resolve as resolve_mode
from webhook.mutation import Mutator
from webhook.nodewatch import node_informer
from webhook.schedwatch import SchedulerPresence, scheduler_informer
from webhook.server import MUTATE_PATH, VALIDATE_PATH, Reviewer, build_app
from webhook.transport import listen
from webhook.waitwatch import WaitExplainer

log = logging.getLogger(__name__)
Handler = Callable[[web.Request], Awaitable[web.Response]]


class ServeConfig(BaseModel):
    """The sections of the configuration file that ``serve`` reads."""

    model_config = ConfigDict(extra="forbid")

    server: ServerConfig = Field(default_factory=ServerConfig)
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig)
    certs: CertsConfig = Field(default_factory=CertsConfig)
    quota: QuotaConfig = Field(default_factory=QuotaConfig)
    extender: ExtenderConfig = Field(default_factory=ExtenderConfig)
    kubeconfig: Path | None = None
    context: str | None = Field(None, description="kubeconfig context (default: the current one)")
    shutdown_delay_seconds: float = Field(
        3.0,
        ge=0,
        description="after SIGTERM, keep answering (not ready) this long so that Service "
        "endpoints drop the replica before it stops",
    )


def load(
    args: argparse.Namespace, admission: AdmissionConfig, document: dict[str, Any] | None = None
) -> ServeConfig:
    raw = dict(load_yaml(args.config) if document is None else document)
    raw.pop("admission", None)  # already read, with flags applied
    try:
        config = ServeConfig.model_validate(raw)
    except ValidationError as exc:
        raise describe(exc, str(args.config)) from None
    _placement_agrees(admission, config.extender.enabled, args.config)
    server = config.server.model_copy(
        update={
            k: v
            for k, v in {
                "host": args.host or ("127.0.0.1" if args.standalone else None),
                "port": args.port,
            }.items()
            if v is not None
        }
    )
    quota = config.quota
    if args.standalone and quota.mode == "kubernetes":
        # No cluster: GPUQuotas come from quota.file, if one is configured.
        quota = quota.model_copy(update={"mode": "embedded"})
    return config.model_copy(
        update={
            "quota": quota,
            "admission": admission,
            "server": server,
            "kubeconfig": args.kubeconfig or config.kubeconfig,
            "context": args.context or config.context,
        }
    )


def _placement_agrees(admission: AdmissionConfig, extender: bool, source: object) -> None:
    """The extender is served exactly when GPU pods are placed by it: served but unused, the
    pods it never sees are placed by the node, while it books cards for others on the same
    nodes; used but not served, every GPU pod waits on a scheduler whose extender fails."""
    if extender and admission.placement != "extender":
        raise ConfigError(
            f"{source}: extender.enabled is true but admission.placement is "
            f"{admission.placement}: the extender places GPU pods only if admission sends them "
            f"to it; remove admission.placement (it then follows extender.enabled) or set "
            f"extender.enabled: false"
        )
    if not extender and admission.placement == "extender":
        raise ConfigError(
            f"{source}: admission.placement is extender but extender.enabled is false: every "
            f"GPU pod would wait on scheduler {admission.scheduler_name}, whose extender this "
            f"server does not serve; set extender.enabled: true, or admission.placement: node"
        )


def serve(
    args: argparse.Namespace, admission: AdmissionConfig, document: dict[str, Any] | None = None
) -> int:
    config = load(args, admission, document)
    try:
        return asyncio.run(run_server(config, standalone=args.standalone))
    except ServingError as exc:
        # Something for the operator to fix, not a bug: one line, no traceback.
        log.error("cannot start: no usable serving certificate", extra={"error": str(exc)})
        return 2
    except ModeError as exc:
        log.error("cannot start: admission mode unknown", extra={"error": str(exc)})
        return 2


@dataclass
class _Wiring:
    """What ``run_server`` builds as it opens each part of the server: the cluster client (none
    standalone), what each path answers, what readiness waits for, and the jobs that run until
    the stop."""

    stack: contextlib.AsyncExitStack
    registry: CollectorRegistry
    api: Api | None = None
    informers: Informers | None = None  # one watch per kind for everything below
    reviewers: dict[str, Reviewer] = field(default_factory=dict)
    waiting: dict[str, Callable[[], bool]] = field(default_factory=dict)  # readiness, by what
    background: list[Awaitable[Any]] = field(default_factory=list)
    stopping: list[str] = field(default_factory=list)

    def readiness(self) -> str | None:
        why = self.stopping + [name for name, ready in self.waiting.items() if not ready()]
        return ", ".join(why) or None


async def run_server(
    config: ServeConfig, *, standalone: bool, stop: asyncio.Event | None = None
) -> int:
    """Serve until ``stop`` is set (by default: until SIGTERM or SIGINT); the exit status."""
    inventory = Inventory(config.admission.inventory.models)
    admission = config.admission
    # Where a scheduler is configured, pods are handed to it only while its Lease is renewed.
    presence = (
        SchedulerPresence(admission.scheduler_lease)
        if admission.scheduler_name and admission.scheduler_lease and not standalone
        else None
    )
    async with contextlib.AsyncExitStack() as stack:
        wiring = _Wiring(stack, CollectorRegistry())
        if not standalone:
            api = await stack.enter_async_context(kube_client(config.kubeconfig, config.context))
            wiring.api, wiring.informers = api, Informers(api)
        certificates = await open_serving(
            config.certs, standalone=standalone, registry=wiring.registry, api=wiring.api
        )
        stack.push_async_callback(certificates.close)
        wiring.waiting["serving certificate"] = certificates.ready
        wiring.background.append(certificates.run())
        quota = await _open_admission(wiring, config, inventory, presence, certificates)
        await _watch_cluster(wiring, config, inventory, presence)
        extender = _open_extender(wiring, config, certificates)
        handlers = {DECIDE_PATH: quota.decide_endpoint}
        await _listen(wiring, config, standalone, certificates, handlers)
        if extender:
            await _listen_extender(wiring, config, certificates, extender)
        status = await _until_stopped(wiring.background, stop)
        wiring.stopping.append("shutting down")
        delay = config.shutdown_delay_seconds if status == 0 else 0.0
        log.info("shutting down", extra={"delay_s": delay})
        await asyncio.sleep(delay)
    log.info("stopped")
    return status


async def _open_admission(
    wiring: _Wiring,
    config: ServeConfig,
    inventory: Inventory,
    presence: SchedulerPresence | None,
    certificates: ServingCertificates,
) -> QuotaService:
    """The mode, the quota service and the mutator for it; the quota service."""
    api, informers = wiring.api, wiring.informers
    mode = await resolve_mode(config.admission.allocation, api)
    log.info("admission mode", extra={"allocation": mode.allocation, "why": mode.why})
    if mode.allocation == "dra" and config.admission.placement == "extender":
        raise ConfigError(
            f"admission.placement is extender (device-plugin mode) but the cluster is "
            f"admitted in DRA mode ({mode.why}); set admission.allocation: device-plugin, or "
            f"admission.placement: node and extender.enabled: false"
        )
    admission = config.admission.model_copy(update={"allocation": mode.allocation})
    # DRA mode: the cards a claim can get are the ones the ResourceSlices publish.
    dra = mode.allocation == "dra" and api is not None
    models = SliceModels() if dra else None
    templates = TemplateStore(api) if dra and api is not None else None
    quota = await open_quota(
        _with_advertise(config.quota, config.server.port),
        api,
        registry=wiring.registry,
        card_memory=models.largest_card_mib if models else inventory.largest_card_mib,
        planned_templates=templates.planned if templates else None,
        most_cards=models.most_cards_on_a_node if models else None,
        peer_ca=certificates.ca_bundle_pem,
        peer_name=config.certs.service_dns_names()[2],
        informers=informers,
    )
    wiring.stack.push_async_callback(quota.close)
    wiring.reviewers[VALIDATE_PATH] = quota.reviewer
    # Jobs of one replica at a time: beside the usage controller, on the quota's leader.
    leading: list[Callable[[], Coroutine[Any, Any, None]]] = []
    wiring.reviewers[MUTATE_PATH] = Mutator(admission, inventory, presence)
    if api is not None and informers is not None:
        # A pod no card can host waits Pending; say why, in its units (the driver's
        # ResourceSlices and claims in DRA mode, the Nodes in device-plugin mode); and one left
        # to a scheduler that is not running, that it is not.
        explainer = WaitExplainer(
            api,
            device_plugin=models is None,
            informers=informers,
            scheduler=(admission.scheduler_name, presence) if presence is not None else None,
        )
        leading.append(explainer.run)
    if api is not None and models is not None and templates is not None:
        wiring.reviewers[MUTATE_PATH] = await _dra_admission(
            wiring,
            api,
            models=models,
            templates=templates,
            admission=admission,
            inventory=inventory,
            presence=presence,
        )
    # Not a readiness condition: mutation needs no quota. While the GPUQuota CRD is missing
    # the quota service logs it once and denies GPU pods with the command that installs it.
    wiring.background.append(quota.run(leading))
    return quota


async def _watch_cluster(
    wiring: _Wiring,
    config: ServeConfig,
    inventory: Inventory,
    presence: SchedulerPresence | None,
) -> None:
    """The Nodes' GPU inventory and the scheduler's Lease, each a readiness condition."""
    api = wiring.api
    if api is not None and config.admission.inventory.watch_nodes:
        informer = node_informer(api, inventory, wiring.informers)
        await wiring.stack.enter_async_context(informer)
        wiring.waiting["GPU inventory (Node list)"] = lambda: informer.has_synced
    if api is not None and presence is not None:
        lease = scheduler_informer(api, presence)
        await wiring.stack.enter_async_context(lease)
        wiring.waiting[f"scheduler Lease {presence.lease}"] = lambda: lease.has_synced


def _open_extender(
    wiring: _Wiring, config: ServeConfig, certificates: ServingCertificates
) -> dict[str, Handler]:
    """The scheduler extender's endpoints, when it is enabled (device-plugin mode with cards
    placed at scheduling time), and the keeper of the scheduler's client certificate. Not a
    readiness condition: admission needs none of it, and until its caches have listed, filter
    answers the scheduler with an error (the pod waits)."""
    if not config.extender.enabled:
        return {}
    if wiring.api is None or wiring.informers is None:
        log.warning("extender enabled but no cluster (standalone): not served")
        return {}
    metrics = ExtenderMetrics(wiring.registry)
    service = ExtenderService(wiring.api, wiring.informers, config.extender, metrics)
    wiring.background.append(service.run())
    source = certificates.source
    if isinstance(source, ManagedSource) and config.certs.mode == "secret":
        scheduler = config.extender.scheduler_deployment
        keeper = ClientCertificateKeeper(
            wiring.api,
            config.certs,
            config.extender.client_secret_name,
            lambda: source.material,
            restart=deployment_restarter(wiring.api, config.certs.namespace, scheduler)
            if scheduler
            else None,
        )
        wiring.background.append(keeper.run())
    elif config.certs.mode == "files":
        # The mounted certificates' issuer (cert-manager, with the chart and the cert-manager
        # overlay) holds the CA key and issues the scheduler's certificate too; the extender's
        # port trusts the CAs in certs.ca_file for it.
        log.info(
            "the scheduler's client certificate is not issued here (certs mode files): the "
            "extender accepts one signed by a CA in certs.ca_file, which the issuer of the "
            "mounted certificates (cert-manager) provides in the scheduler's Secret",
            extra={
                "ca_file": str(config.certs.ca_file),
                "secret": f"{config.certs.namespace}/{config.extender.client_secret_name}",
            },
        )
    else:
        # directory mode: the CA key is here, but there is no Secret to share a certificate by.
        log.warning(
            "the scheduler's client certificate is issued only in certs mode secret; issue "
            "one (clientAuth) from the CA that signs the serving certificate yourself",
            extra={"certs_mode": config.certs.mode},
        )
    return service.routes()


async def _listen_extender(
    wiring: _Wiring,
    config: ServeConfig,
    certificates: ServingCertificates,
    routes: Mapping[str, Handler],
) -> None:
    """The extender's own listener: the same certificate as admission's, and a client
    certificate from fracgpu's CA required (the scheduler's), because bind binds pods with
    serve's permissions. Its limits are admission's; probes stay on the admission port, which
    kubelet can reach without a client certificate."""
    app = build_app({}, limits=config.server.limits, handlers=routes)
    port = config.extender.port
    listener = await listen(app, config.server.host, port, certificates.mutual_context)
    wiring.stack.push_async_callback(listener.close)
    log.info(
        "serving the scheduler extender (client certificate required)",
        extra={"host": config.server.host, "port": port, "paths": sorted(routes)},
    )


async def _listen(
    wiring: _Wiring,
    config: ServeConfig,
    standalone: bool,
    certificates: ServingCertificates,
    handlers: Mapping[str, Handler],
) -> None:
    app = build_app(
        wiring.reviewers,
        metrics=AdmissionMetrics(wiring.registry),
        readiness=wiring.readiness,
        limits=config.server.limits,
        handlers=handlers,
    )
    listener = await listen(app, config.server.host, config.server.port, certificates.context)
    wiring.stack.push_async_callback(listener.close)
    log.info(
        "serving admission",
        extra={
            "host": config.server.host,
            "port": config.server.port,
            "standalone": standalone,
            "paths": sorted(wiring.reviewers),
        },
    )
    if standalone:
        _print_try_it(config, config.certs.directory / CA_BUNDLE)


def _with_advertise(quota: QuotaConfig, port: int) -> QuotaConfig:
    """Where other replicas reach this one when it leads quota: the configured URL, else the
    pod's own address from the downward API (POD_IP); without either it advertises none."""
    if quota.advertise_url is not None:
        return quota
    pod_ip = os.environ.get("POD_IP", "")
    if not pod_ip:
        return quota
    host = f"[{pod_ip}]" if ":" in pod_ip else pod_ip
    return quota.model_copy(update={"advertise_url": f"https://{host}:{port}"})


async def _dra_admission(
    wiring: _Wiring,
    api: Api,
    *,
    models: SliceModels,
    templates: TemplateStore,
    admission: AdmissionConfig,
    inventory: Inventory,
    presence: SchedulerPresence | None,
) -> Mutator:
    """DRA mode: GPU models from the driver's ResourceSlices, and claim templates made on
    demand and collected when unused."""
    slices = slice_informer(api, models, wiring.informers)
    await wiring.stack.enter_async_context(slices)
    wiring.waiting["GPU models (ResourceSlice list)"] = lambda: slices.has_synced
    wiring.background.append(templates.collect_forever())
    return Mutator(admission, inventory, presence, claim_models=models.models, templates=templates)


class _Stopped(Exception):
    """SIGTERM, SIGINT or the caller's stop event: a clean end, not a failure."""


async def _raise_when(stop: asyncio.Event) -> None:
    await stop.wait()
    raise _Stopped


async def _until_stopped(background: list[Awaitable[Any]], stop: asyncio.Event | None) -> int:
    """Run the background jobs until stopped (0) or until one of them fails (1).

    A job that returns has finished its work (the embedded quota has nothing to reconcile),
    which is not a failure: the server keeps serving. The task group cancels the other jobs
    when one fails or the stop event raises.
    """
    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
    status = 0
    try:
        async with asyncio.TaskGroup() as group:
            for job in background:
                group.create_task(_as_coroutine(job))
            group.create_task(_raise_when(stop))
    except* _Stopped:
        pass  # a clean stop: status 0
    except* Exception as failed:
        log.error("a background task failed; stopping", exc_info=failed.exceptions[0])
        status = 1
    return status


async def _as_coroutine(job: Awaitable[Any]) -> None:
    await job


def _print_try_it(config: ServeConfig, ca_file: Path) -> None:
    url = f"https://{config.server.host}:{config.server.port}"
    ca = f"--cacert {ca_file} "
    print(
        f"""
fracgpu admission webhook on {url} (standalone)
Try it from another terminal:
  curl {ca}{url}/healthz
  curl {ca}-H 'Content-Type: application/json' --data @examples/admissionreview-pod.json \\
       {url}/mutate
  .venv/bin/fracgpu review --config examples/config.yaml examples/pod-fraction.yaml
Stop with Ctrl-C.
""",
        file=sys.stderr,
        flush=True,
    )
