"""The JSON patch operations admission writes into a GPU pod, common to both modes.

Each container's resources in the canonical form (or, in DRA mode, its claim) and the variables
fracgpu gives it; and for the pod the configured tolerations, the annotations that record the
original request (and, in device-plugin mode, each share's policy), and the scheduler. Every
operation is built against the exact JSON the apiserver sent, and adds only what is missing,
so that applying the mutation to its own output changes nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic_core import to_json

from core.policy import POLICY_ANNOTATION
from core.units import CANONICAL, REQUEST_ANNOTATION, Grant
from webhook.claims import ClaimPlan
from webhook.config import AdmissionConfig
from webhook.podmodels import PodModels
from webhook.podwalk import Located
from webhook.resources import ContainerResult

_CANONICAL = frozenset(CANONICAL)
# What admission replaces with the configured scheduler: the pod named none of its own.
DEFAULT_SCHEDULERS = (None, "", "default-scheduler")
# The variables of each grant remembered (see PodPatcher.granted_env); cleared when full.
ENV_MEMO_SIZE = 4096


def escape(token: str) -> str:
    """RFC 6901 escaping for one JSON Pointer token (``fracgpu.io/request`` → ``…~1request``)."""
    if "~" in token or "/" in token:
        return token.replace("~", "~0").replace("/", "~1")
    return token


def pointer(*tokens: str | int) -> str:
    return "/" + "/".join(escape(t) if isinstance(t, str) else str(t) for t in tokens)


class SchedulerCheck(Protocol):
    """Says why the configured scheduler is not running (None: it is)."""

    def not_running(self) -> str | None: ...


@dataclass(frozen=True)
class PodTarget:
    """One pod (or pod template) being mutated, and where it sits in the reviewed object."""

    root: str  # JSON pointer of the pod within the reviewed object ("" for a Pod)
    spec: Mapping[str, Any]
    meta: Mapping[str, Any]
    has_meta: bool
    results: list[Located]
    models: PodModels = field(default_factory=PodModels)
    policy: str | None = None  # the compute-policy annotation device-plugin mode writes


class PodPatcher:
    """Builds the operations from the admission configuration: the operator's extra
    variables and tolerations, and the scheduler GPU pods are handed to."""

    def __init__(
        self,
        config: AdmissionConfig,
        inputs: frozenset[str],
        scheduler: SchedulerCheck | None = None,
    ) -> None:
        self.config = config
        self.inputs = inputs
        self.scheduler = scheduler
        self._env: dict[Grant, dict[str, str]] = {}

    def granted_env(self, grant: Grant) -> dict[str, str]:
        """The variables a grant puts in its container, configured extras included."""
        env = self._env.get(grant)
        if env is None:
            if len(self._env) >= ENV_MEMO_SIZE:
                self._env.clear()
            env = self._env[grant] = {**grant.env(), **self.config.env}
        return env

    def env_of(self, result: ContainerResult, plan: ClaimPlan | None) -> dict[str, str]:
        """The variables fracgpu puts in a container's spec, configured extras included. In DRA
        mode the grant's variables come from the node (the claim's CDI spec), which knows the
        card the claim got; the spec gets only the operator's extras."""
        if plan is not None:
            return dict(self.config.env)
        return self.granted_env(result.grant) if result.grant is not None else {}

    def container_ops(
        self,
        ops: list[dict[str, Any]],
        where: str,
        container: Mapping[str, Any],
        result: ContainerResult,
        *,
        claim: str | None = None,
        claim_env: Mapping[str, str] | None = None,
    ) -> None:
        """The container's resources in the canonical form, or (DRA mode, ``claim``) with the
        request language removed and the container naming its pod claim; and its variables."""
        resources = container.get("resources")
        assert isinstance(resources, dict)  # it named a GPU resource
        wanted = result.grant.resources() if result.grant else {}
        new: dict[str, Any] = {
            k: v for k, v in resources.items() if k not in ("limits", "requests")
        }
        if claim is not None:
            held = new.get("claims")
            claims = [c for c in held if isinstance(c, dict)] if isinstance(held, list) else []
            if all(c.get("name") != claim for c in claims):
                claims.append({"name": claim})
            new["claims"] = claims
        for part in ("limits", "requests"):
            current = resources.get(part)
            kept = {k: v for k, v in (current or {}).items() if k not in self.inputs}
            merged = {**kept, **wanted}
            if merged or part == "limits":
                new[part] = merged
        if new != resources:
            ops.append({"op": "replace", "path": f"{where}/resources", "value": new})
        if claim_env is not None:
            desired: Mapping[str, str] = claim_env
        elif result.grant is not None:
            desired = self.granted_env(result.grant)
        else:
            return
        _env_ops(ops, where, container, desired)

    def scheduler_op(
        self, ops: list[dict[str, Any]], warnings: list[str], spec: Mapping[str, Any]
    ) -> None:
        """Hand a GPU pod to the configured scheduler, but only while it runs.

        Only pods, never templates: a template keeps its value for every pod made from it, and
        a scheduler that stops later would leave those pods waiting with no event. Each pod
        is decided when it is created.

        With extender placement, always: the card is chosen and recorded only by that
        scheduler's extender, so a pod handed to another scheduler while it is down would be
        bound with no card recorded. It waits instead, and the user is told why (a pod naming
        another scheduler never gets here: ``webhook.scheduling`` denies it).
        """
        scheduler = self.config.scheduler_name
        current = spec.get("schedulerName")
        why = self.scheduler.not_running() if self.scheduler is not None else None
        if self.config.extender_placement:
            if scheduler and why is not None:
                warnings.append(
                    f"scheduler {scheduler} is not running ({why}); the pod waits Pending until "
                    f"it runs: its GPU card is chosen only by that scheduler's extender "
                    f"(admission.placement: extender)"
                )
        elif not (
            scheduler
            and current != scheduler
            and (current in DEFAULT_SCHEDULERS or self.config.override_scheduler)
        ):
            return
        elif why is not None:
            warnings.append(
                f"scheduler {scheduler} is not running ({why}); the pod keeps "
                f"{current or 'the default scheduler'} so that it does not wait unscheduled"
            )
            return
        if scheduler and current != scheduler:
            op = "add" if current is None else "replace"
            ops.append({"op": op, "path": "/spec/schedulerName", "value": scheduler})

    def pod_ops(self, ops: list[dict[str, Any]], pod: PodTarget) -> None:
        """The configured tolerations the pod lacks, then its annotations."""
        root, spec = pod.root, pod.spec
        tolerations = spec.get("tolerations")
        present = tolerations if isinstance(tolerations, list) else []
        needed = [t for t in self.config.tolerations if not _tolerated(t, present)]
        if needed and not isinstance(tolerations, list):
            ops.append({"op": "add", "path": f"{root}/spec/tolerations", "value": needed})
        else:
            ops.extend(
                {"op": "add", "path": f"{root}/spec/tolerations/-", "value": t} for t in needed
            )
        annotation_ops(ops, pod)


def _env_ops(
    ops: list[dict[str, Any]], where: str, container: Mapping[str, Any], desired: Mapping[str, str]
) -> None:
    """The variables of ``desired`` the container does not set yet."""
    env = container.get("env")
    have = (
        {str(v.get("name")) for v in env if isinstance(v, dict)} if isinstance(env, list) else set()
    )
    missing = [{"name": k, "value": v} for k, v in desired.items() if k not in have]
    if not missing:
        return
    if not isinstance(env, list):
        ops.append({"op": "add", "path": f"{where}/env", "value": missing})
    else:
        ops.extend({"op": "add", "path": f"{where}/env/-", "value": v} for v in missing)


def annotation_ops(ops: list[dict[str, Any]], pod: PodTarget) -> None:
    """The original request (and the policies read from it), and the model annotations."""
    root = pod.root
    annotations = pod.meta.get("annotations")
    present = annotations if isinstance(annotations, dict) else {}
    wanted = dict(pod.models.write)
    existing = present.get(REQUEST_ANNOTATION)
    asked = {r.name: r.request for *_, r in pod.results if r.grant is not None or r.ask is not None}
    already_canonical = all(req.keys() <= _CANONICAL for req in asked.values())
    # Not when it is our own earlier output (reinvocation, or a pod made from a mutated
    # template).
    dropped: list[str] = []
    if existing is None or not already_canonical:
        # Sorted, compact JSON: the same request always gives the same annotation.
        wanted[REQUEST_ANNOTATION] = to_json(
            {name: dict(sorted(asked[name].items())) for name in sorted(asked)}
        ).decode()
        # The policy goes with the request it was read from (a template's pods keep it).
        if pod.policy is not None:
            wanted[POLICY_ANNOTATION] = pod.policy
        elif POLICY_ANNOTATION in present:
            dropped.append(POLICY_ANNOTATION)
    changed = {k: v for k, v in wanted.items() if present.get(k) != v}
    for key in dropped:
        ops.append({"op": "remove", "path": f"{root}/metadata/annotations/{escape(key)}"})
    if not changed:
        return
    if not pod.has_meta:
        ops.append({"op": "add", "path": f"{root}/metadata", "value": {}})
    if not isinstance(annotations, dict):
        ops.append({"op": "add", "path": f"{root}/metadata/annotations", "value": {}})
    for key, value in changed.items():
        op = "replace" if key in present else "add"
        path = f"{root}/metadata/annotations/{escape(key)}"
        ops.append({"op": op, "path": path, "value": value})


def _tolerated(wanted: Mapping[str, Any], present: list[Any]) -> bool:
    """True when an existing toleration already tolerates the taint ``wanted`` is for."""
    for t in present:
        if not isinstance(t, dict):
            continue
        if t.get("operator") == "Exists" and not t.get("key") and not t.get("effect"):
            return True  # tolerates everything
        same_key = t.get("key") == wanted.get("key")
        same_effect = not t.get("effect") or t.get("effect") == wanted.get("effect")
        if (
            same_key
            and same_effect
            and (t.get("operator") == "Exists" or t.get("value") == wanted.get("value"))
        ):
            return True
    return False
