"""Which mode a cluster's GPU pods are admitted in, and which one it should be installed in.

Two questions with different answers. *Installing*: DRA mode is the default wherever the cluster
has it (the API server serves ``resource.k8s.io/v1`` and is Kubernetes 1.36 or later, where DRA's
consumable capacity is on by default); device-plugin mode elsewhere. *Admitting*: the webhook
must rewrite pods for the node agent that actually runs, or they never schedule, so with
``admission.allocation: auto`` (the default) ``fracgpu serve`` asks the cluster what is
installed: fracgpu's DeviceClass comes with the DRA overlay and its node agent, and only with
it. An operator can still set ``dra`` or ``device-plugin``.
"""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp

from core import dra
from core.kube import DEVICE_CLASSES, KubeError, KubeNotFound, call_json

log = logging.getLogger(__name__)

Allocation = Literal["device-plugin", "dra"]
DRA_SINCE = (1, 36)
DECIDE_WITHIN_S = 60.0  # serve retries this long before it gives up starting


class ModeError(RuntimeError):
    """``auto`` could not be decided: the API server did not answer, or refused to say."""


@dataclass(frozen=True, slots=True)
class Mode:
    allocation: Allocation
    why: str


@dataclass(frozen=True, slots=True)
class Cluster:
    """What decides the mode: the API server's version and what it serves and holds."""

    version: tuple[int, int] | None  # None: the API server did not say
    serves_dra: bool  # resource.k8s.io/v1 DeviceClasses
    device_class: bool  # fracgpu's DeviceClass is installed

    @property
    def supports_dra(self) -> bool:
        return self.serves_dra and self.version is not None and self.version >= DRA_SINCE

    @property
    def version_text(self) -> str:
        if self.version is None:
            return "an unknown version"
        return f"{self.version[0]}.{self.version[1]}"


def _minor(raw: Any) -> int | None:
    match = re.match(r"\d+", str(raw or ""))  # "37", or "37+" from some distributions
    return int(match.group()) if match else None


async def read_cluster(api: Any) -> Cluster:
    """Ask the API server. Raises KubeError (or a connection error) when it does not answer."""
    info = await call_json(api, "GET", "/version")
    major, minor = _minor(info.get("major")), _minor(info.get("minor"))
    version = (major, minor) if major is not None and minor is not None else None
    try:
        group = await call_json(api, "GET", f"/apis/{dra.API_VERSION}")
        serves = any(r.get("name") == "deviceclasses" for r in group.get("resources") or [])
    except KubeNotFound:
        serves = False
    installed = serves and await _exists(api, DEVICE_CLASSES.path(name=dra.DEVICE_CLASS))
    return Cluster(version, serves, installed)


async def _exists(api: Any, path: str) -> bool:
    try:
        await call_json(api, "GET", path)
    except KubeNotFound:
        return False
    return True


def to_install(cluster: Cluster) -> Mode:
    """The mode to install fracgpu in on this cluster."""
    if cluster.supports_dra:
        return Mode(
            "dra",
            f"Kubernetes {cluster.version_text} serves DRA with consumable capacity: DRA mode is "
            "the default here; the stock scheduler places every share on one card",
        )
    why = (
        f"Kubernetes {cluster.version_text} does not serve {dra.API_VERSION} DeviceClasses"
        if not cluster.serves_dra
        else f"Kubernetes {cluster.version_text} is older than 1.36 (DRA's consumable capacity)"
    )
    return Mode("device-plugin", f"{why}: device-plugin mode")


def admitting(cluster: Cluster) -> Mode:
    """The mode to admit pods in: the one whose node agent is installed."""
    if cluster.device_class:
        note = (
            ""
            if cluster.supports_dra
            else f" (but Kubernetes {cluster.version_text} is older than the 1.36 DRA mode needs)"
        )
        return Mode(
            "dra",
            f"DeviceClass {dra.DEVICE_CLASS} is installed, and with it the DRA plugin{note}",
        )
    hint = (
        "; this cluster supports DRA mode, the default where it can run: install "
        "deploy/overlays/dra to move to it"
        if cluster.supports_dra
        else ""
    )
    return Mode(
        "device-plugin",
        f"no DeviceClass {dra.DEVICE_CLASS}: the device plugin serves the nodes{hint}",
    )


async def resolve(configured: str, api: Any | None, within_s: float = DECIDE_WITHIN_S) -> Mode:
    """The mode ``serve`` admits in. ``auto`` asks the cluster, retrying while the API server
    does not answer (a wrong guess would send every GPU pod to a node agent that is not there);
    raises ModeError after ``within_s``, or at once when the API server refuses to say."""
    if configured in ("dra", "device-plugin"):
        chosen: Allocation = "dra" if configured == "dra" else "device-plugin"
        return Mode(chosen, "set in the configuration (admission.allocation)")
    if api is None:
        return Mode("device-plugin", "standalone: no cluster to ask")
    deadline = asyncio.get_running_loop().time() + within_s
    while True:
        try:
            return admitting(await read_cluster(api))
        except KubeError as exc:
            if exc.status == 403:
                raise ModeError(
                    f"admission.allocation auto must read DeviceClass {dra.DEVICE_CLASS} and was "
                    f"refused ({exc}): grant get on it (deploy/base/webhook-rbac.yaml does), or "
                    "set admission.allocation to dra or device-plugin"
                ) from None
            error: Exception = exc
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            error = exc
        if asyncio.get_running_loop().time() > deadline:
            raise ModeError(
                f"admission.allocation auto: the API server did not say within {within_s:g} s "
                f"whether DRA mode is installed ({error}); set admission.allocation to dra or "
                "device-plugin to start without asking"
            )
        log.warning("cannot tell the mode yet; asking again", extra={"error": str(error)})
        await asyncio.sleep(2.0)
