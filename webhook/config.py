"""Configuration of the admission side, with the defaults documented in docs/operator-guide.md.

One YAML file (``fracgpu serve --config``) whose sections belong to the components that read
them; unknown keys are errors, so a typo never silently falls back to a default.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from core.contract import MAX_DEVICES, VISIBLE_DEVICES_ENV
from core.units import SYSTEM_ENV_PREFIX
from webhook.dialects import OPTIONAL_DIALECTS, Dialect
from webhook.sizing import DEFAULT_MAX_CARDS

SCHEDULER_PROFILE = "fracgpu-scheduler"
"""The optional packing profile deploy/ runs; ``scheduler_name`` names it to use it."""

Placement = Literal["node", "extender"]
"""Who chooses a device-plugin pod's card: the node's plugin once kubelet admits the container
(``node``), or fracgpu's scheduler extender as the pod is bound (``extender``, recorded on the
pod in ``fracgpu.io/placement``; docs/design/extender-memo.md)."""

DEFAULT_TOLERATIONS: list[dict[str, str]] = [
    {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class InventoryConfig(_Section):
    models: dict[str, int] = Field(
        default_factory=dict,
        description="GPU product name → memory in MiB, for clusters without node labels "
        "and for standalone use",
    )
    watch_nodes: bool = Field(True, description="list+watch Nodes for GPU labels in a cluster")

    @field_validator("models")
    @classmethod
    def _positive(cls, models: dict[str, int]) -> dict[str, int]:
        for name, mib in models.items():
            if mib < 256:
                raise ValueError(f"inventory.models[{name!r}]: {mib} MiB is less than 256 MiB")
        return models


class AdmissionConfig(_Section):
    allocation: Literal["auto", "device-plugin", "dra"] = Field(
        "auto",
        description="how shares reach cards: dra (ResourceClaims placed by the stock scheduler "
        "on one card, Kubernetes 1.36 or later with fracgpu dra-plugin on the nodes), "
        "device-plugin (extended resources fracgpu.io/core and fracgpu.io/memory, any "
        "Kubernetes), or auto: dra where fracgpu's DeviceClass is installed (it comes with the "
        "DRA plugin), else device-plugin; decided at start and logged",
    )
    dialects: list[Dialect] = Field(
        default_factory=list, description="extra vocabularies to accept: hami, tkestack"
    )
    # Empty by default: a pod handed to a scheduler that is not running waits in Pending with
    # no event at all, and the stock scheduler already places shares correctly.
    scheduler_name: str = Field(
        "", description=f"scheduler set on GPU pods (such as {SCHEDULER_PROFILE}); empty leaves it"
    )
    scheduler_lease: str = Field(
        f"fracgpu/{SCHEDULER_PROFILE}",
        description="namespace/name of the Lease the leader of scheduler_name renews; GPU pods "
        "are handed to it only while the Lease is renewed; empty: always (no check)",
    )
    override_scheduler: bool = Field(
        False, description="also replace a scheduler the pod names (other than default)"
    )
    tolerations: list[dict[str, Any]] = Field(default_factory=lambda: list(DEFAULT_TOLERATIONS))
    env: dict[str, str] = Field(
        default_factory=dict, description="extra variables for GPU containers, if unset"
    )
    inventory: InventoryConfig = Field(default_factory=InventoryConfig)
    allow_privileged: bool = Field(
        False, description="admit privileged containers in GPU pods (they see every GPU)"
    )
    max_cards: int = Field(
        DEFAULT_MAX_CARDS,
        ge=1,
        le=MAX_DEVICES,
        description="whole cards one container may ask for; more could never be scheduled",
    )
    # Declared after allocation and scheduler_name: its validator reads them.
    placement: Placement = Field(
        "node",
        description="device-plugin mode: who chooses each GPU pod's card; extender: fracgpu's "
        "scheduler extender, so every GPU pod is sent to scheduler_name (whatever its Lease "
        "says) and may not preset spec.nodeName or name another scheduler; fracgpu serve "
        "takes extender when extender.enabled is true and this is unset",
    )

    @field_validator("dialects")
    @classmethod
    def _optional_only(cls, dialects: list[Dialect]) -> list[Dialect]:
        for d in dialects:
            if d not in OPTIONAL_DIALECTS:
                raise ValueError(f"{d.value!r} is always enabled; list only hami or tkestack")
        return dialects

    @field_validator("scheduler_lease")
    @classmethod
    def _namespaced(cls, lease: str) -> str:
        namespace, slash, name = lease.partition("/")
        if lease and not (slash and namespace and name and "/" not in name):
            raise ValueError(f"{lease!r}: write the Lease as namespace/name")
        return lease

    @field_validator("placement")
    @classmethod
    def _placement_has_a_scheduler(cls, placement: Placement, info: ValidationInfo) -> Placement:
        problem = placement_problem(
            placement, info.data.get("allocation"), info.data.get("scheduler_name")
        )
        if problem is not None:
            raise ValueError(problem)
        return placement

    @property
    def extender_placement(self) -> bool:
        """GPU pods go to the scheduler whose extender records their card: the setting, in
        device-plugin mode (DRA mode's claims are placed by the stock scheduler)."""
        return self.placement == "extender" and self.allocation != "dra"

    @field_validator("env")
    @classmethod
    def _not_system(cls, env: dict[str, str]) -> dict[str, str]:
        for name in env:
            if name.startswith(SYSTEM_ENV_PREFIX) or name == VISIBLE_DEVICES_ENV:
                raise ValueError(f"env {name}: this variable is set by fracgpu itself")
        return env


def placement_problem(placement: str, allocation: object, scheduler_name: object) -> str | None:
    """Why extender placement cannot work with these settings, or None. Checked when the file
    is read and again once command-line flags are applied (``--scheduler-name ''``)."""
    if placement != "extender":
        return None
    if allocation == "dra":
        return (
            "extender placement is for device-plugin mode; with allocation: dra the stock "
            "scheduler places each claim; set allocation to device-plugin (or auto), or "
            "placement to node"
        )
    if not scheduler_name:
        return (
            f"extender placement needs scheduler_name: the scheduler profile that calls the "
            f"extender (deploy/overlays/default runs {SCHEDULER_PROFILE}); without it GPU pods "
            f"would be bound with no card recorded"
        )
    return None


MIB = 2**20


class ServerLimits(_Section):
    """What clients may hold on a replica. kube-apiserver keeps a pool of connections, sends a
    request as soon as it connects, and posts bodies of a few KiB (a very large pod: a few MiB);
    the defaults leave it ample room and bound everyone else."""

    max_connections: int = Field(
        256,
        ge=1,
        description="open connections per replica; a new one above it closes the connection "
        "that has been idle longest (one that never sent a request first), or is itself "
        "closed when every connection has a request in progress",
    )
    handshake_timeout_seconds: float = Field(
        10.0, gt=0, description="a TLS handshake not finished by then is dropped"
    )
    header_timeout_seconds: float = Field(
        10.0,
        gt=0,
        description="complete request headers must arrive this soon after connecting or "
        "after the first byte of a request",
    )
    idle_timeout_seconds: float = Field(
        120.0,
        gt=0,
        description="an idle keep-alive connection is closed after this long; longer than "
        "the 90 s after which Go's HTTP client (the API server's) drops idle connections by "
        "default, so that the client closes first and never sends on a closing connection",
    )
    body_timeout_seconds: float = Field(
        10.0, gt=0, description="the whole body must arrive this soon after its headers"
    )
    max_body_bytes: int = Field(
        8 * MIB,
        ge=64 * 1024,
        description="larger bodies are refused with HTTP 413 before they are read",
    )
    max_inflight_body_bytes: int = Field(
        64 * MIB,
        description="bytes of request bodies being read or reviewed at once, by their "
        "Content-Length; bodies over 1 MiB may hold at most half of it, so ordinary reviews "
        "always find room",
    )

    large_body_bytes_per_second: int = Field(
        4 * MIB,
        ge=MIB,
        description="bodies over 1 MiB are let in one at a time at this rate (a burst of one "
        "largest body): each costs milliseconds of parsing in one piece, which every review "
        "waiting then shares",
    )

    @model_validator(mode="after")
    def _room_for_one_large_body(self) -> ServerLimits:
        if self.max_inflight_body_bytes < 2 * self.max_body_bytes:
            raise ValueError(
                f"server.limits.max_inflight_body_bytes ({self.max_inflight_body_bytes}) must "
                f"be at least twice server.limits.max_body_bytes ({self.max_body_bytes}): "
                "large bodies may use only half of it, and one must always fit"
            )
        return self


class ServerConfig(_Section):
    host: str = "0.0.0.0"
    port: int = Field(8443, ge=1, le=65535)
    limits: ServerLimits = Field(default_factory=ServerLimits)


class ConfigError(ValueError):
    """The configuration file cannot be used; the message says which key and why."""


def load_yaml(path: Path | None) -> dict[str, Any]:
    """Read a YAML mapping, or {} for no file; errors name the file and the problem."""
    if path is None:
        return {}
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the configuration must be a YAML mapping")
    return data


def describe(exc: ValidationError, source: str) -> ConfigError:
    lines = [
        f"{source}: {'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in exc.errors()
    ]
    return ConfigError("\n".join(lines))
