"""The GPUQuota object (``fracgpu.io/v1``): its spec in the user's units, its status on the wire.

The spec is parsed once, here, into canonical integers (hundredths of a card, MiB, pods), so
the ledger never sees a quantity string. The status is what admission and the controller
write with resourceVersion compare-and-swap; it keeps the canonical integers the arithmetic
needs *and* display strings (``cards: "3.70"``) for kubectl's printer columns, which can only
show fields, not compute them.

The object itself is kept as the raw dict the API server returned, so a status write sends
back every field we do not model (labels, managedFields, future spec fields) untouched.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic.alias_generators import to_camel

from core.units import DOMAIN, UnitError, cards_text, parse_cards, parse_mib

GROUP = DOMAIN
VERSION = "v1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "GPUQuota"
PLURAL = "gpuquotas"


class QuotaError(ValueError):
    """A GPUQuota that cannot be used; the message names the quota, the field and the rule."""


class _Wire(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")


class LimitSpec(BaseModel):
    """Limits of one scope (the namespace, or one GPU model); None means not limited."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    gpu: int | None = Field(default=None, description="hundredths of a card")
    gpumem: int | None = Field(default=None, description="MiB")
    pods: int | None = Field(default=None, description="GPU pods")

    @field_validator("gpu", mode="before")
    @classmethod
    def _cards(cls, raw: Any) -> int | None:
        return None if raw is None else parse_cards(raw, source="quota")

    @field_validator("gpumem", mode="before")
    @classmethod
    def _memory(cls, raw: Any) -> int | None:
        return None if raw is None else parse_mib(raw, source="quota")

    @field_validator("pods", mode="before")
    @classmethod
    def _pods(cls, raw: Any) -> int | None:
        return None if raw is None else _parse_pods(raw)

    @property
    def empty(self) -> bool:
        return self.gpu is None and self.gpumem is None and self.pods is None


class QuotaSpec(LimitSpec):
    """The namespace-wide limits plus optional limits per GPU model (the product label value)."""

    models: dict[str, LimitSpec] = Field(default_factory=dict)


class Amount(_Wire):
    """An amount of GPU in canonical integers, with the cards also as text for kubectl."""

    cards: str = "0.00"
    core: int = 0
    memory_mib: int = Field(
        default=0, validation_alias="memoryMiB", serialization_alias="memoryMiB"
    )
    pods: int = 0

    @classmethod
    def of(cls, core: int, memory_mib: int, pods: int) -> Amount:
        return cls(cards=cards_text(core), core=core, memory_mib=memory_mib, pods=pods)


class Used(Amount):
    models: dict[str, Amount] = Field(default_factory=dict)


class PendingWire(_Wire):
    """One recent admission the controller has not yet matched to a pod."""

    uid: str
    pod: str = ""
    core: int = 0
    memory_mib: int = Field(
        default=0, validation_alias="memoryMiB", serialization_alias="memoryMiB"
    )
    # GPU models the pod may land on; absent means any model.
    models: list[str] | None = None
    at: datetime


class UnmatchedWire(Used):
    """Admissions folded out of ``pending``; ``newest`` is the latest admission folded in."""

    newest: datetime | None = None


class Condition(_Wire):
    type: str
    status: str
    reason: str = ""
    message: str = ""
    last_transition_time: datetime | None = None


# The controller has counted the namespace's pods for the current spec: admission may use
# ``used``. Until then (a new quota, a changed spec, a status that was reset) it denies.
COUNTED = "Counted"
# Whether admissions are being matched to pods (the controller runs); written by whoever notices.
CONTROLLER_ACTIVE = "ControllerActive"


class QuotaStatus(_Wire):
    used: Used = Field(default_factory=Used)
    pending: list[PendingWire] = Field(default_factory=list)
    unmatched: UnmatchedWire | None = None
    conditions: list[Condition] = Field(default_factory=list)
    observed_generation: int | None = None
    last_reconcile_time: datetime | None = None

    def wire(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")

    def condition(self, kind: str) -> Condition | None:
        return next((c for c in self.conditions if c.type == kind), None)

    def with_condition(self, condition: Condition) -> QuotaStatus:
        """This status with ``condition`` replacing the one of its type; the transition time
        is kept when status and reason did not change (as Kubernetes conditions do)."""
        previous = self.condition(condition.type)
        if previous is not None and (previous.status, previous.reason) == (
            condition.status,
            condition.reason,
        ):
            condition = condition.model_copy(
                update={"last_transition_time": previous.last_transition_time}
            )
        others = [c for c in self.conditions if c.type != condition.type]
        return self.model_copy(
            update={"conditions": sorted([*others, condition], key=lambda c: c.type)}
        )


class GPUQuota:
    """One GPUQuota: the raw object, its parsed spec and status."""

    __slots__ = ("raw", "spec", "status")

    def __init__(self, raw: Mapping[str, Any]) -> None:
        # Shallow copies: the raw object is never mutated below its top level and metadata.
        self.raw: dict[str, Any] = dict(raw)
        self.raw["metadata"] = dict(self.raw.get("metadata") or {})
        self.spec = parse_spec(self.raw)
        try:
            self.status = QuotaStatus.model_validate(_upgraded(self.raw.get("status") or {}))
        except ValidationError:
            # A status we cannot read is rebuilt by the controller; admission must not trust it.
            raise QuotaError(
                f"GPUQuota {self.ref}: status is not readable; the fracgpu controller rebuilds "
                f"it (or delete and recreate the quota)"
            ) from None

    @property
    def meta(self) -> dict[str, Any]:
        meta = self.raw.setdefault("metadata", {})
        assert isinstance(meta, dict)
        return meta

    @property
    def name(self) -> str:
        return str(self.meta.get("name", ""))

    @property
    def namespace(self) -> str:
        return str(self.meta.get("namespace", ""))

    @property
    def ref(self) -> str:
        return f'"{self.namespace}/{self.name}"'

    @property
    def resource_version(self) -> str:
        return str(self.meta.get("resourceVersion", ""))

    @property
    def generation(self) -> int | None:
        value = self.meta.get("generation")
        return value if isinstance(value, int) else None

    @property
    def uid(self) -> str:
        return str(self.meta.get("uid", ""))

    def counted(self) -> bool:
        """Whether the controller has counted the pods for this spec (see :data:`COUNTED`)."""
        condition = self.status.condition(COUNTED)
        return (
            condition is not None
            and condition.status == "True"
            and self.status.observed_generation == self.generation
        )

    def with_status(self, status: QuotaStatus) -> GPUQuota:
        """A copy carrying ``status`` (and this object's resourceVersion, for the CAS write)."""
        copy = GPUQuota.__new__(GPUQuota)  # spec and status are known: no second parse
        copy.raw = {**self.raw, "metadata": dict(self.meta), "status": status.wire()}
        copy.spec, copy.status = self.spec, status
        return copy


def parse_spec(raw: Mapping[str, Any]) -> QuotaSpec:
    meta = raw.get("metadata") or {}
    ref = f'"{meta.get("namespace", "")}/{meta.get("name", "")}"'
    spec = raw.get("spec")
    if not isinstance(spec, Mapping):
        raise QuotaError(f"GPUQuota {ref}: spec is missing; set at least one of gpu or gpumem")
    try:
        parsed = QuotaSpec.model_validate(spec)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = "spec." + ".".join(str(p) for p in first["loc"])
        cause = first.get("ctx", {}).get("error")
        if first["type"] == "extra_forbidden":
            rule = "is not a GPUQuota field (the fields are gpu, gpumem, pods and models)"
        else:
            rule = str(cause) if isinstance(cause, UnitError) else first["msg"]
        value = first.get("input")
        raise QuotaError(f"GPUQuota {ref}: {where} {rule}; got {value!r}") from None
    if parsed.empty and not parsed.models:
        raise QuotaError(
            f"GPUQuota {ref}: spec limits nothing; set at least one of gpu, gpumem, pods or models"
        )
    return parsed


def now() -> datetime:
    return datetime.now(UTC)


PODS_RULE = "must be a whole number of pods, 0 or more"


def _parse_pods(raw: object) -> int:
    if isinstance(raw, bool) or not isinstance(raw, int) or raw < 0:
        raise UnitError(PODS_RULE)
    return raw


def _upgraded(status: Mapping[str, Any]) -> Mapping[str, Any]:
    """A status written by a release that kept one reservation per pod, in today's form.

    Its ``used`` counted only pods the controller had seen and ``reservations`` held the
    rest; today ``used`` is the whole charge and ``pending`` the unseen admissions. Without
    this an upgrade would forget what was admitted but not yet counted.
    """
    old = status.get("reservations")
    if not isinstance(old, Mapping) or "pending" in status:
        return status
    upgraded = {k: v for k, v in status.items() if k not in ("reservations", "reserved", "hard")}
    used = dict(status.get("used") or {})
    pending = []
    for uid, entry in old.items():
        if not isinstance(entry, Mapping):
            continue
        pending.append({"uid": uid, **entry, "at": entry.get("expires") or now().isoformat()})
        for key in ("core", "memoryMiB"):
            used[key] = int(used.get(key) or 0) + int(entry.get(key) or 0)
        used["pods"] = int(used.get("pods") or 0) + 1
    used.pop("models", None)  # per-model shares are recounted; until then not counted
    upgraded["used"] = used
    upgraded["pending"] = pending
    return upgraded
