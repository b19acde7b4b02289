"""The resource kinds the fake API server serves, and what the real server does per kind.

A `Kind` carries exactly the per-kind behaviour that clients can observe: the URL (group, version,
plural), scope, whether a `/status` subresource splits spec from status, whether it is a custom
resource (custom resources refuse strategic merge patches and unconditional updates, and keep
`kind`/`apiVersion` on list items), which field selectors it supports and which top-level fields
it has (unknown ones are dropped with a warning, or refused under `fieldValidation=Strict`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

_META_FIELDS = frozenset({"metadata.name", "metadata.namespace"})
_COMMON_TOP = frozenset({"apiVersion", "kind", "metadata"})


@dataclass(frozen=True)
class Kind:
    group: str  # "" for the core group
    version: str
    kind: str
    plural: str
    namespaced: bool
    status_subresource: bool = False
    custom: bool = False
    tracks_generation: bool = False
    returns_deleted_object: bool = False  # DELETE answers with the object, not a Status
    field_labels: frozenset[str] = _META_FIELDS
    top_fields: frozenset[str] = field(default=frozenset({"spec", "status"}))

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def resource(self) -> str:
        """How the real server names the resource in messages: `pods`, `gpuquotas.fracgpu.io`."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    @property
    def allowed_top_fields(self) -> frozenset[str]:
        return _COMMON_TOP | self.top_fields

    @property
    def prefix(self) -> str:
        return f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"


POD = Kind(
    "",
    "v1",
    "Pod",
    "pods",
    namespaced=True,
    status_subresource=True,
    returns_deleted_object=True,
    field_labels=_META_FIELDS
    | {
        "spec.nodeName",
        "spec.restartPolicy",
        "spec.schedulerName",
        "spec.serviceAccountName",
        "status.phase",
        "status.podIP",
        "status.nominatedNodeName",
    },
)
NODE = Kind(
    "",
    "v1",
    "Node",
    "nodes",
    namespaced=False,
    status_subresource=True,
    field_labels=frozenset({"metadata.name", "spec.unschedulable"}),
)
NAMESPACE = Kind(
    "",
    "v1",
    "Namespace",
    "namespaces",
    namespaced=False,
    status_subresource=True,
    returns_deleted_object=True,
    field_labels=frozenset({"metadata.name", "status.phase"}),
)
SECRET = Kind(
    "",
    "v1",
    "Secret",
    "secrets",
    namespaced=True,
    field_labels=_META_FIELDS | {"type"},
    top_fields=frozenset({"data", "stringData", "type", "immutable"}),
)
CONFIGMAP = Kind(
    "",
    "v1",
    "ConfigMap",
    "configmaps",
    namespaced=True,
    top_fields=frozenset({"data", "binaryData", "immutable"}),
)
EVENT = Kind(
    "",
    "v1",
    "Event",
    "events",
    namespaced=True,
    field_labels=_META_FIELDS
    | {
        "involvedObject.kind",
        "involvedObject.namespace",
        "involvedObject.name",
        "involvedObject.uid",
        "involvedObject.apiVersion",
        "involvedObject.resourceVersion",
        "involvedObject.fieldPath",
        "reason",
        "reportingComponent",
        "source",
        "type",
    },
    top_fields=frozenset(
        {
            "involvedObject",
            "reason",
            "message",
            "source",
            "firstTimestamp",
            "lastTimestamp",
            "count",
            "type",
            "eventTime",
            "series",
            "action",
            "related",
            "reportingComponent",
            "reportingInstance",
        }
    ),
)
LEASE = Kind("coordination.k8s.io", "v1", "Lease", "leases", namespaced=True)
MUTATING_WEBHOOK_CONFIGURATION = Kind(
    "admissionregistration.k8s.io",
    "v1",
    "MutatingWebhookConfiguration",
    "mutatingwebhookconfigurations",
    namespaced=False,
    tracks_generation=True,
    field_labels=frozenset({"metadata.name"}),
    top_fields=frozenset({"webhooks"}),
)
VALIDATING_WEBHOOK_CONFIGURATION = Kind(
    "admissionregistration.k8s.io",
    "v1",
    "ValidatingWebhookConfiguration",
    "validatingwebhookconfigurations",
    namespaced=False,
    tracks_generation=True,
    field_labels=frozenset({"metadata.name"}),
    top_fields=frozenset({"webhooks"}),
)
GPUQUOTA = Kind(
    "fracgpu.io",
    "v1",
    "GPUQuota",
    "gpuquotas",
    namespaced=True,
    status_subresource=True,
    custom=True,
    tracks_generation=True,
    returns_deleted_object=True,
)
# The scheduler extender's per-node ledger: not served by default (the CRD installs it);
# `FakeApiServer.register` it in tests that need it.
GPUNODELEDGER = Kind(
    "fracgpu.io",
    "v1",
    "GPUNodeLedger",
    "gpunodeledgers",
    namespaced=False,
    custom=True,
    tracks_generation=True,
    returns_deleted_object=True,
    field_labels=frozenset({"metadata.name"}),
    top_fields=frozenset({"spec"}),
)
DEPLOYMENT = Kind(
    "apps", "v1", "Deployment", "deployments", namespaced=True, status_subresource=True
)
REPLICASET = Kind(
    "apps", "v1", "ReplicaSet", "replicasets", namespaced=True, status_subresource=True
)
STATEFULSET = Kind(
    "apps", "v1", "StatefulSet", "statefulsets", namespaced=True, status_subresource=True
)
DAEMONSET = Kind("apps", "v1", "DaemonSet", "daemonsets", namespaced=True, status_subresource=True)
JOB = Kind("batch", "v1", "Job", "jobs", namespaced=True, status_subresource=True)
CRONJOB = Kind("batch", "v1", "CronJob", "cronjobs", namespaced=True, status_subresource=True)

# resource.k8s.io/v1 (dynamic resource allocation), served by default from Kubernetes 1.34 on.
RESOURCE_SLICE = Kind(
    "resource.k8s.io",
    "v1",
    "ResourceSlice",
    "resourceslices",
    namespaced=False,
    field_labels=frozenset({"metadata.name", "spec.nodeName", "spec.driver"}),
    top_fields=frozenset({"spec"}),
)
RESOURCE_CLAIM = Kind(
    "resource.k8s.io",
    "v1",
    "ResourceClaim",
    "resourceclaims",
    namespaced=True,
    status_subresource=True,
    returns_deleted_object=True,
)
RESOURCE_CLAIM_TEMPLATE = Kind(
    "resource.k8s.io",
    "v1",
    "ResourceClaimTemplate",
    "resourceclaimtemplates",
    namespaced=True,
    returns_deleted_object=True,
    top_fields=frozenset({"spec"}),
)
DEVICE_CLASS = Kind(
    "resource.k8s.io",
    "v1",
    "DeviceClass",
    "deviceclasses",
    namespaced=False,
    tracks_generation=True,
    returns_deleted_object=True,
    field_labels=frozenset({"metadata.name"}),
    top_fields=frozenset({"spec"}),
)
DRA_KINDS = (RESOURCE_SLICE, RESOURCE_CLAIM, RESOURCE_CLAIM_TEMPLATE, DEVICE_CLASS)
# A component's identity, as the e2e harness installs it from deploy/ (the fake authorizes
# nothing: it stores these so that a run can be set up and removed against it).
SERVICE_ACCOUNT = Kind(
    "", "v1", "ServiceAccount", "serviceaccounts", namespaced=True, top_fields=frozenset()
)
_RBAC = "rbac.authorization.k8s.io"
_RULES = frozenset({"rules", "aggregationRule"})
_BINDING = frozenset({"roleRef", "subjects"})
RBAC_KINDS = (
    Kind(_RBAC, "v1", "ClusterRole", "clusterroles", namespaced=False, top_fields=_RULES),
    Kind(_RBAC, "v1", "ClusterRoleBinding", "clusterrolebindings", False, top_fields=_BINDING),
    Kind(_RBAC, "v1", "Role", "roles", namespaced=True, top_fields=_RULES),
    Kind(_RBAC, "v1", "RoleBinding", "rolebindings", namespaced=True, top_fields=_BINDING),
)

DEFAULT_KINDS: tuple[Kind, ...] = (
    POD,
    NODE,
    NAMESPACE,
    SECRET,
    CONFIGMAP,
    EVENT,
    LEASE,
    MUTATING_WEBHOOK_CONFIGURATION,
    VALIDATING_WEBHOOK_CONFIGURATION,
    GPUQUOTA,
    *DRA_KINDS,
    SERVICE_ACCOUNT,
    *RBAC_KINDS,
    DEPLOYMENT,
    REPLICASET,
    STATEFULSET,
    DAEMONSET,
    JOB,
    CRONJOB,
)
