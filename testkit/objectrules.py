"""Object rules the fake API server enforces on writes, and the defaults it fills in on create.

A small, deliberate subset of kube-apiserver's validation: the checks that catch mistakes our
components could make (names, label and annotation keys and values, a pod without containers,
pod spec changes outside the mutable fields, writes to an immutable Secret, bad base64), each
answered as the real server does (422 Invalid with the field, or 400). Defaulting is limited to
the pod fields that admission webhooks see already defaulted (schedulerName, restartPolicy,
terminationGracePeriodSeconds, dnsPolicy), the pod's Pending phase, a namespace's Active phase,
and the Secret type.
"""

from __future__ import annotations

import base64
import binascii
import re
from datetime import UTC, datetime, timedelta

from testkit import draobjects
from testkit.apierrors import bad_request, invalid
from testkit.apistore import Obj, clone
from testkit.kinds import DRA_KINDS, NAMESPACE, POD, SECRET, Kind

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
GENERATE_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"  # the real server's, without vowels
_MUTABLE_POD_SPEC = ("activeDeadlineSeconds", "tolerations", "schedulingGates")


def now(offset_s: float = 0.0) -> str:
    """An RFC 3339 timestamp in whole seconds, as metadata timestamps are written."""
    return (datetime.now(UTC) + timedelta(seconds=offset_s)).strftime("%Y-%m-%dT%H:%M:%SZ")


def qualified_name(key: str) -> bool:
    if not isinstance(key, str) or not key:
        return False
    prefix, slash, name = key.rpartition("/")
    if slash and (not prefix or len(prefix) > 253 or not _DNS_SUBDOMAIN.match(prefix)):
        return False
    return len(name) <= 63 and bool(_QUALIFIED_NAME.match(name))


def validate(kind: Kind, obj: Obj) -> None:
    meta = obj["metadata"]
    name = meta.get("name", "")
    causes: list[tuple[str, str]] = []
    pattern, limit = (_DNS_LABEL, 63) if kind is NAMESPACE else (_DNS_SUBDOMAIN, 253)
    if not isinstance(name, str) or not pattern.match(name) or len(name) > limit:
        causes.append(
            (
                "metadata.name",
                f'Invalid value: "{name}": a lowercase RFC 1123 name must consist of lower '
                "case alphanumeric characters, '-' or '.', and must start and end with an "
                "alphanumeric character",
            )
        )
    for field in ("labels", "annotations"):
        entries = meta.get(field) or {}
        if not isinstance(entries, dict):
            causes.append((f"metadata.{field}", "Invalid value: must be a map of strings"))
            continue
        for key, value in entries.items():
            if not qualified_name(key):
                causes.append(
                    (
                        f"metadata.{field}",
                        f'Invalid value: "{key}": name part must consist of '
                        "alphanumeric characters, '-', '_' or '.', and must start and end "
                        "with an alphanumeric character (prefix: an optional DNS subdomain "
                        "and '/')",
                    )
                )
            if not isinstance(value, str):
                causes.append((f"metadata.{field}", f"Invalid value: {key}: must be a string"))
            elif field == "labels" and (len(value) > 63 or not _LABEL_VALUE.match(value)):
                causes.append(
                    (
                        "metadata.labels",
                        f'Invalid value: "{value}": a valid label must be an empty string or '
                        "consist of alphanumeric characters, '-', '_' or '.', and must start "
                        "and end with an alphanumeric character, at most 63 characters",
                    )
                )
    if kind is POD:
        containers = (obj.get("spec") or {}).get("containers")
        if not isinstance(containers, list) or not containers:
            causes.append(("spec.containers", "Required value"))
        else:
            for i, container in enumerate(containers):
                if not isinstance(container, dict) or not container.get("name"):
                    causes.append((f"spec.containers[{i}].name", "Required value"))
                elif not container.get("image"):
                    causes.append((f"spec.containers[{i}].image", "Required value"))
    if causes:
        raise invalid(kind, name if isinstance(name, str) else "", causes)
    if kind in DRA_KINDS:
        draobjects.validate(kind, obj)


def rewrite(kind: Kind, obj: Obj) -> None:
    """What the server changes in every object it stores (create and update)."""
    if kind in DRA_KINDS:
        draobjects.canonicalize(kind, obj, now())


def check_immutable(kind: Kind, old: Obj, new: Obj) -> None:
    name = old["metadata"]["name"]
    if kind in DRA_KINDS:
        draobjects.check_immutable(kind, old, new)
    if kind is POD:
        old_spec = clone(old.get("spec") or {})
        new_spec = clone(new.get("spec") or {})
        for spec in (old_spec, new_spec):
            for field in _MUTABLE_POD_SPEC:
                spec.pop(field, None)
            for group in ("containers", "initContainers"):
                for container in spec.get(group) or []:
                    if isinstance(container, dict):
                        container.pop("image", None)
        if old_spec != new_spec:
            raise invalid(
                kind,
                name,
                [
                    (
                        "spec",
                        "Forbidden: pod updates may not change fields other than "
                        "`spec.containers[*].image`, `spec.initContainers[*].image`, "
                        "`spec.activeDeadlineSeconds`, `spec.tolerations` (only additions to "
                        "existing tolerations), `spec.schedulingGates` (only removal); use "
                        "the binding subresource to set spec.nodeName",
                    )
                ],
            )
    if kind is SECRET and old.get("immutable"):
        for field in ("data", "immutable"):
            if old.get(field) != new.get(field):
                raise invalid(
                    kind,
                    name,
                    [(field, "Forbidden: field is immutable when `immutable` is set")],
                )


def fold_secret_data(kind: Kind, obj: Obj) -> None:
    """Secrets: stringData is write-only and merges into data; data must be base64."""
    if kind is not SECRET:
        return
    data = obj.get("data") or {}
    for key, value in (obj.pop("stringData", None) or {}).items():
        data[key] = base64.b64encode(str(value).encode()).decode()
    for key, value in data.items():
        try:
            base64.b64decode(str(value), validate=True)
        except binascii.Error:
            raise bad_request(
                'Secret in version "v1" cannot be handled as a Secret: '
                f"illegal base64 data in data[{key!r}]"
            ) from None
    if data:
        obj["data"] = data
    obj.setdefault("type", "Opaque")


def defaults_on_create(kind: Kind, obj: Obj) -> None:
    if kind is POD:
        spec = obj.setdefault("spec", {})
        spec.setdefault("schedulerName", "default-scheduler")
        spec.setdefault("restartPolicy", "Always")
        spec.setdefault("terminationGracePeriodSeconds", 30)
        spec.setdefault("dnsPolicy", "ClusterFirst")
        obj["status"] = {"phase": "Pending"}
    elif kind is NAMESPACE:
        obj.setdefault("spec", {"finalizers": ["kubernetes"]})
        obj["status"] = {"phase": "Active"}
    elif kind.custom and kind.status_subresource:
        obj.pop("status", None)
