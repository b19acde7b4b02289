"""Configuration of GPU quota (the ``quota:`` section of the webhook's configuration)."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class LeaderElection(BaseModel):
    """Which replica runs the usage controller: the holder of a coordination.k8s.io Lease."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(
        default=True, description="Off only when exactly one replica runs the controller."
    )
    lease_name: str = "fracgpu-quota-controller"
    lease_namespace: str | None = Field(
        default=None,
        description="Default: $POD_NAMESPACE (downward API), else fracgpu.",
    )
    identity: str | None = Field(default=None, description="Default: $POD_NAME or hostname.")
    lease_duration_s: float = Field(
        default=15.0, gt=0, description="How long a Lease is valid without renewal."
    )
    renew_interval_s: float = Field(
        default=5.0, gt=0, description="How often the leader renews (and others retry)."
    )

    @model_validator(mode="after")
    def _renew_within_lease(self) -> LeaderElection:
        if self.renew_interval_s >= self.lease_duration_s:
            raise ValueError(
                f"leader_election.renew_interval_s ({self.renew_interval_s:g}) must be shorter "
                f"than lease_duration_s ({self.lease_duration_s:g}), or the Lease lapses between "
                f"renewals"
            )
        return self

    def namespace(self) -> str:
        return self.lease_namespace or os.environ.get("POD_NAMESPACE") or "fracgpu"

    def holder(self) -> str:
        return (
            self.identity or os.environ.get("POD_NAME") or f"{socket.gethostname()}-{os.getpid()}"
        )


class QuotaConfig(BaseModel):
    """GPU quota settings; every default is what a cluster should start with."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["kubernetes", "embedded"] = Field(
        default="kubernetes",
        description="kubernetes: GPUQuota objects in the cluster; embedded: from `file`, "
        "in memory (no cluster; every admitted pod stays charged until restart).",
    )
    file: Path | None = Field(
        default=None, description="Embedded mode: YAML file of GPUQuota objects."
    )
    require_quota: bool = Field(
        default=False,
        description="Deny GPU pods in namespaces without a GPUQuota (default: unlimited).",
    )
    timeout_s: float = Field(
        default=5.0,
        gt=0,
        description="Longest a quota decision may take before the pod is denied as "
        "unverifiable; keep it below the webhook's timeoutSeconds (default 10).",
    )
    request_timeout_s: float = Field(
        default=2.0, gt=0, description="Longest one API server call may take."
    )
    max_attempts: int = Field(
        default=20,
        ge=1,
        description="Status writes tried per quota on 409 Conflict (within timeout_s).",
    )
    reservation_grace_s: float = Field(
        default=10.0,
        gt=0,
        description="How long an admission waits for its pod to appear before the controller "
        "may release it (after a GET finds no such pod). Safety needs every create that "
        "admission allowed to be persisted within this time or never (docs/quota.md).",
    )
    pending_limit: int = Field(
        default=8,
        ge=1,
        le=64,
        description="Admissions recorded one by one in a GPUQuota's status; older ones are "
        "aggregated, so the object stays a few KB at any number of pods.",
    )
    count_wait_s: float = Field(
        default=2.0,
        ge=0,
        description="How long a GPU pod waits for the controller to count a GPUQuota that is "
        "new or changed before it is denied as 'not yet known'; below timeout_s.",
    )
    stale_after_s: float = Field(
        default=60.0,
        gt=0,
        description="An admission still not matched to a pod after this long means the quota "
        "controller is not running: said on the GPUQuota, in a metric and in denials.",
    )
    resync_s: float = Field(
        default=30.0, gt=0, description="Controller: full reconcile of every GPUQuota this often."
    )
    leader_election: LeaderElection = Field(default_factory=LeaderElection)
    forward_to_leader: bool = Field(
        default=True,
        description="Send this replica's quota decisions to the replica that runs the "
        "controller, so that one replica writes each GPUQuota and replicas do not conflict "
        "under load. A replica still decides itself when the leader cannot be reached.",
    )
    advertise_url: str | None = Field(
        default=None,
        description="Where the other replicas reach this one while it leads. Default: "
        "https://$POD_IP:<server.port> (downward API); without POD_IP this replica decides "
        "only the pods sent to it.",
    )

    @model_validator(mode="after")
    def _consistent(self) -> QuotaConfig:
        if self.mode == "kubernetes" and self.file is not None:
            raise ValueError(
                "quota.file is read only in embedded mode; set quota.mode: embedded, or remove "
                "quota.file to use the cluster's GPUQuota objects"
            )
        if self.request_timeout_s > self.timeout_s:
            raise ValueError(
                f"quota.request_timeout_s ({self.request_timeout_s:g}) must not exceed "
                f"quota.timeout_s ({self.timeout_s:g})"
            )
        if self.count_wait_s >= self.timeout_s:
            raise ValueError(
                f"quota.count_wait_s ({self.count_wait_s:g}) must be shorter than "
                f"quota.timeout_s ({self.timeout_s:g}), or waiting for a new GPUQuota to be "
                f"counted ends in a timeout instead of a clear denial"
            )
        return self
