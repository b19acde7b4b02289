"""Mutation of GPU pods and of the pod templates of built-in workloads (design §3).

For each object the webhook either denies with every problem named, or returns a JSON patch
built against the exact JSON the apiserver sent: the request rewritten into the canonical form,
the original recorded in an annotation, scheduler, tolerations and environment added, and a
GPU model the pod chose in its annotations honoured (``_Models``). Applying
the mutation to its own output changes nothing (reinvocation is a no-op), and objects that ask
for no GPU pass untouched.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic_core import to_json

from core.admission import AdmissionRequest, AdmissionResponse
from core.labels import (
    MODEL_ANNOTATION,
    MODEL_EXCLUDE_ANNOTATION,
    PRODUCT_LABEL,
    ModelChoiceError,
    ModelSet,
    choose_models,
    label_value,
    model_key,
    model_lists,
    pinned_products,
)
from core.policy import (
    HARD_CAP,
    POLICY_ANNOTATION,
    PRIORITY_ANNOTATION,
    Priority,
    SharePolicy,
    encode_annotation,
)
from core.units import CANONICAL, REQUEST_ANNOTATION, Grant
from webhook.checks import Container, PodView, forbidden
from webhook.claims import (
    TEMPLATE_PREFIX,
    ClaimPlan,
    TemplateError,
    plan_claim,
    pod_claim_name,
    with_policy,
)
from webhook.config import AdmissionConfig
from webhook.inventory import Inventory
from webhook.resources import (
    Card,
    CardChoice,
    ContainerResult,
    Dialect,
    RequestError,
    container_ref,
    enabled,
    input_resources,
    normalise_container,
    quote,
)

# Where the pod template lives in each built-in workload kind, by (API group, kind).
TEMPLATE_PATHS: dict[tuple[str, str], tuple[str, ...]] = {
    ("", "Pod"): (),
    ("apps", "Deployment"): ("spec", "template"),
    ("apps", "ReplicaSet"): ("spec", "template"),
    ("apps", "StatefulSet"): ("spec", "template"),
    ("apps", "DaemonSet"): ("spec", "template"),
    ("batch", "Job"): ("spec", "template"),
    ("batch", "CronJob"): ("spec", "jobTemplate", "spec", "template"),
}
CONTAINER_LISTS = ("initContainers", "containers")
EPHEMERAL_CONTAINERS = "ephemeralContainers"
EPHEMERAL = "ephemeralcontainers"  # the Pod subresource kubectl debug writes
_CANONICAL = frozenset(CANONICAL)
DENY_LIMIT = 8  # problems listed in one denial; more would be truncated by kubectl anyway
# Normalised containers remembered by the mutator (see Mutator._normalise); cleared when full.
MEMO_SIZE = 4096


def escape(token: str) -> str:
    """RFC 6901 escaping for one JSON Pointer token (``fracgpu.io/request`` → ``…~1request``)."""
    if "~" in token or "/" in token:
        return token.replace("~", "~0").replace("/", "~1")
    return token


def pointer(*tokens: str | int) -> str:
    return "/" + "/".join(escape(t) if isinstance(t, str) else str(t) for t in tokens)


Located = tuple[str, int, Mapping[str, Any], ContainerResult]  # list, index, container, result


@dataclass(frozen=True)
class _Models:
    """The GPU models a pod chose in its annotations, and what admission must say or write.

    ``chosen`` is None when the pod chose nothing. ``write`` holds fracgpu's model annotations
    as they must read when the choice came (also) from HAMi's: quota, ``fracgpu review`` and a
    later admission then read one vocabulary.
    """

    chosen: ModelSet | None = None
    errors: tuple[str, ...] = ()
    write: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class _Pod:
    """One pod (or pod template) being mutated, and where it sits in the reviewed object."""

    root: str  # JSON pointer of the pod within the reviewed object ("" for a Pod)
    spec: Mapping[str, Any]
    meta: Mapping[str, Any]
    has_meta: bool
    results: list[Located]
    models: _Models = field(default_factory=_Models)
    policy: str | None = None  # the compute-policy annotation device-plugin mode writes


REQUIRED = "requiredDuringSchedulingIgnoredDuringExecution"


class SchedulerCheck(Protocol):
    """Says why the configured scheduler is not running (None: it is)."""

    def not_running(self) -> str | None: ...


class Templates(Protocol):
    """Makes sure a claim template exists in a namespace (DRA mode; ``webhook.claimstore``).
    Raises TemplateError when it cannot."""

    async def ensure(self, namespace: str, plan: ClaimPlan, *, dry_run: bool) -> None: ...


@dataclass
class Outcome:
    """The decision for one object: allowed with a patch, or denied with messages."""

    patch: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    gpu: bool = False
    templates: list[ClaimPlan] = field(default_factory=list)  # DRA mode: what the patch names
    models: ModelSet | None = None  # the GPU models the pod chose, as admission honours them

    @property
    def allowed(self) -> bool:
        return not self.errors

    @property
    def message(self) -> str:
        shown = self.errors[:DENY_LIMIT]
        more = len(self.errors) - len(shown)
        return "; ".join(shown) + (f"; and {more} more" if more > 0 else "")


class Mutator:
    """The ``/mutate`` reviewer and the engine behind ``fracgpu review``."""

    def __init__(
        self,
        config: AdmissionConfig,
        inventory: Inventory,
        scheduler: SchedulerCheck | None = None,
        *,
        claim_models: Callable[[], Mapping[str, Card]] | None = None,
        templates: Templates | None = None,
    ) -> None:
        self.config = config
        self.inventory = inventory
        self.scheduler = scheduler
        # DRA mode: claims sized per GPU model the cluster's ResourceSlices publish.
        self.dra = config.allocation == "dra"
        self.claim_models = claim_models or inventory.models
        self.templates = templates
        self.dialects = enabled(config.dialects)
        self.inputs = input_resources(self.dialects)
        self.hami = Dialect.HAMI in self.dialects
        self._memo: dict[tuple[Any, ...], tuple[CardChoice, ContainerResult]] = {}
        self._env: dict[Grant, dict[str, str]] = {}

    def _normalise(self, name: str, resources: Any, choice: CardChoice) -> ContainerResult:
        """``normalise_container``, remembered: the replicas of a Job or Deployment arrive as
        a burst of pods with the same containers, and normalising one is most of a mutation.

        Only text values are remembered (the apiserver sends every quantity as text), so
        ``True``, ``1`` and ``1.0``, which hash alike but parse differently, never share an
        entry. The card choice is keyed by identity (the inventory hands out the same object
        until a node's cards change), and each entry holds its choice, so an identity is never
        reused while its entry lives. Results are shared between pods and never modified.
        """
        key = _memo_key(name, resources, self.inputs, id(choice))
        max_cards, sized = self.config.max_cards, not self.dra
        if key is None:
            return normalise_container(
                name, resources, self.dialects, choice, max_cards, sized=sized
            )
        entry = self._memo.get(key)
        if entry is not None and entry[0] is choice:
            return entry[1]
        if len(self._memo) >= MEMO_SIZE:
            self._memo.clear()
        result = normalise_container(name, resources, self.dialects, choice, max_cards, sized=sized)
        self._memo[key] = (choice, result)
        return result

    def _granted_env(self, grant: Grant) -> dict[str, str]:
        """The variables a grant puts in its container, configured extras included."""
        env = self._env.get(grant)
        if env is None:
            if len(self._env) >= MEMO_SIZE:
                self._env.clear()
            env = self._env[grant] = {**grant.env(), **self.config.env}
        return env

    async def __call__(self, req: AdmissionRequest) -> AdmissionResponse:
        if (req.kind.kind, req.sub_resource, req.operation) == ("Pod", EPHEMERAL, "UPDATE"):
            return self._ephemeral(req)
        if req.operation not in ("CREATE", "UPDATE") or req.sub_resource or req.object is None:
            return AdmissionResponse.allow(req.uid, label="not-applicable")
        if req.kind.kind == "Pod" and req.operation == "UPDATE":
            # Container resources of a pod are immutable; what was admitted at CREATE stands.
            return AdmissionResponse.allow(req.uid, label="not-applicable")
        outcome = self.mutate(req.object, req.kind.group, req.kind.kind)
        if outcome.allowed and outcome.templates and self.templates is not None:
            namespace = req.namespace or "default"
            try:
                for plan in outcome.templates:
                    await self.templates.ensure(namespace, plan, dry_run=req.dry_run)
            except TemplateError as exc:
                outcome.errors.append(str(exc))
        return respond(req.uid, outcome)

    def _ephemeral(self, req: AdmissionRequest) -> AdmissionResponse:
        """``kubectl debug`` adds ephemeral containers to a running pod: they are checked like
        any of its containers (a privileged one, or one that sets NVIDIA_VISIBLE_DEVICES, would
        see every card), and nothing else of the pod, admitted at its creation, is changed."""
        pod = req.object if isinstance(req.object, dict) else {}
        outcome = self.mutate_pod(pod)
        if not outcome.allowed:
            return respond(req.uid, outcome)
        return AdmissionResponse.allow(req.uid, label="ephemeral")

    def mutate(self, obj: Mapping[str, Any], group: str, kind: str) -> Outcome:
        """Mutate an object of a supported kind; other kinds pass untouched."""
        path = TEMPLATE_PATHS.get((group, kind))
        if path is None:
            return Outcome()
        template: Any = obj
        for token in path:
            template = template.get(token) if isinstance(template, dict) else None
        if not isinstance(template, dict):
            return Outcome()
        return self.mutate_pod(template, path)

    def mutate_pod(self, pod: Mapping[str, Any], base: tuple[str, ...] = ()) -> Outcome:
        """Mutate a Pod, or a pod template found at ``base`` inside its object."""
        outcome = Outcome()
        spec = pod.get("spec")
        if not isinstance(spec, dict):
            return outcome
        raw_meta = pod.get("metadata")
        meta: Mapping[str, Any] = raw_meta if isinstance(raw_meta, dict) else {}
        models = self._models(spec, meta)
        choice = self.inventory.choose(spec, models.chosen)
        results: list[Located] = []
        for list_name in CONTAINER_LISTS:
            containers = spec.get(list_name)
            if not isinstance(containers, list):
                continue
            for index, container in enumerate(containers):
                if not isinstance(container, dict):
                    continue
                name = str(container.get("name") or f"{list_name}[{index}]")
                result = self._normalise(name, container.get("resources"), choice)
                outcome.errors.extend(result.errors)
                for warning in result.warnings:
                    if warning not in outcome.warnings:
                        outcome.warnings.append(warning)
                results.append((list_name, index, container, result))
        claimed = _claimed_env(spec)
        if any(r.mentions_gpu for *_, r in results) or claimed:
            outcome.errors.extend(models.errors)  # a pod with no GPU gets no model either
        priority = _pod_priority(meta, outcome.errors)
        policies = {
            (list_name, index): _policy_of(result, priority)
            for list_name, index, _, result in results
        }
        asked = any(r.ask is not None and not r.ask.exact for *_, r in results)
        # Only where the request is read: a pod made from a mutated template carries its
        # policy already, and says nothing of a burst in its canonical resources.
        if priority is not None and asked and not any(p.ceiling for p in policies.values()):
            outcome.warnings.append(
                f"annotation {PRIORITY_ANNOTATION}: {priority} has no effect: priority orders "
                f"the shares that borrow idle compute, and no share of this pod may burst; ask "
                f"less fracgpu.io/gpu in requests than in limits to let a share burst"
            )
        plans = self._plan_claims(results, outcome, models.chosen) if self.dra else {}
        plans = {key: with_policy(plan, policies[key]) for key, plan in plans.items()}
        outcome.gpu = any(r.grant is not None for *_, r in results) or bool(plans)
        checked = results + self._ephemeral_containers(spec, outcome.errors)
        envs = {
            (list_name, index): self._env_of(result, plans.get((list_name, index)))
            or claimed.get((list_name, index), {})
            for list_name, index, _, result in checked
        }
        checks = self._view(spec, meta, checked, outcome.gpu or bool(claimed), envs)
        outcome.errors.extend(forbidden(checks, self.config))
        if outcome.errors:
            outcome.warnings.clear()
            return outcome
        if not any(r.mentions_gpu for *_, r in results):
            return outcome
        ops = outcome.patch
        root = pointer(*base) if base else ""
        for list_name, index, container, result in results:
            where = f"{root}/spec/{list_name}/{index}"
            plan = plans.get((list_name, index))
            if plan is not None:
                claim = pod_claim_name(list_name, index)
                env = envs[list_name, index]
                self._container_ops(ops, where, container, result, claim=claim, claim_env=env)
            elif result.mentions_gpu or result.grant is not None:
                self._container_ops(ops, where, container, result)
        if plans:
            self._claim_ops(ops, root, spec, plans)
            outcome.templates = list({plan.name: plan for plan in plans.values()}.values())
        if outcome.gpu:
            outcome.models = models.chosen
            policy = (
                None
                if plans
                else encode_annotation(
                    {result.name: policies[ln, ix] for ln, ix, _, result in results}
                )
            )
            view = _Pod(root, spec, meta, isinstance(raw_meta, dict), results, models, policy)
            if models.chosen is not None and not plans:
                _affinity_op(ops, root, spec, model_expressions(models.chosen))
            self._pod_ops(ops, view)
            if not base:
                self._scheduler_op(outcome, spec)
        return outcome

    def _models(self, spec: Mapping[str, Any], meta: Mapping[str, Any]) -> _Models:
        """The pod's model choice, checked against the models the cluster knows.

        Entries are held to the known models only while a request is being sized (first
        admission): the canonical form, and a pod holding claims from our templates, were
        checked when their workload was admitted, and must pass while those models' pools are
        scaled to zero (like the canonical form's memory, see ``webhook.resources``).
        """
        annotations = meta.get("annotations")
        try:
            only, never = model_lists(annotations, hami=self.hami)
            if not only and not never:
                return _Models()
            known = self.claim_models() if self.dra else self.inventory.models()
            chosen = choose_models(only, never, known, strict=self._sizes(spec))
        except ModelChoiceError as exc:
            return _Models(errors=(str(exc),))
        assert chosen is not None and isinstance(annotations, dict)
        errors: list[str] = []
        pinned = pinned_products(spec)
        if pinned is not None and not any(p in chosen for p in pinned[1]):
            key, products = pinned
            said = " and ".join(lst.annotation for lst in only + never)
            errors.append(
                f"the pod pins {key} to {', '.join(sorted(products))} (nodeSelector or required "
                f"node affinity), which {said} does not allow; choose the model in one place: "
                f"remove the pin, or make the annotation name the pinned model"
            )
        write: dict[str, str] = {}
        if any(lst.substring for lst in only + never) and self._sizes(spec):
            if chosen.only is not None:
                write[MODEL_ANNOTATION] = ",".join(sorted(chosen.only))
            if chosen.excluded:
                write[MODEL_EXCLUDE_ANNOTATION] = ",".join(sorted(chosen.excluded))
        return _Models(chosen, tuple(errors), write)

    def _sizes(self, spec: Mapping[str, Any]) -> bool:
        """Whether a container asks in a request language rather than the canonical form."""
        for list_name in CONTAINER_LISTS:
            containers = spec.get(list_name)
            for container in containers if isinstance(containers, list) else ():
                resources = container.get("resources") if isinstance(container, dict) else None
                for part in ("limits", "requests"):
                    section = resources.get(part) if isinstance(resources, dict) else None
                    if any(k in self.inputs and k not in _CANONICAL for k in _keys(section)):
                        return True
        return False

    def _ephemeral_containers(self, spec: Mapping[str, Any], errors: list[str]) -> list[Located]:
        """Ephemeral containers hold no resources; they are only checked, never rewritten."""
        found: list[Located] = []
        containers = spec.get(EPHEMERAL_CONTAINERS)
        for index, container in enumerate(containers if isinstance(containers, list) else ()):
            if not isinstance(container, dict):
                continue
            name = str(container.get("name") or f"{EPHEMERAL_CONTAINERS}[{index}]")
            resources = container.get("resources")
            asked = sorted(
                key
                for part in ("limits", "requests")
                for key in _keys(resources.get(part) if isinstance(resources, dict) else None)
                if key in self.inputs
            )
            if asked:
                errors.append(
                    f"{container_ref(name)}: is an ephemeral container and asks for "
                    f"{', '.join(asked)}; ephemeral containers get no GPU, remove the resources"
                )
            found.append((EPHEMERAL_CONTAINERS, index, container, ContainerResult(name)))
        return found

    def _plan_claims(
        self, results: list[Located], outcome: Outcome, chosen: ModelSet | None
    ) -> dict[tuple[str, int], ClaimPlan]:
        """DRA mode: the claim template each GPU container's claim is made from (only the
        models the pod chose, if it did)."""
        models = {
            product: card
            for product, card in self.claim_models().items()
            if chosen is None or product in chosen
        }
        plans: dict[tuple[str, int], ClaimPlan] = {}
        for list_name, index, _, result in results:
            if result.ask is None:
                continue
            try:
                plan = plan_claim(
                    result.name,
                    result.ask,
                    models,
                    max_cards=self.config.max_cards,
                    chosen=chosen,
                )
            except RequestError as exc:
                outcome.errors.append(str(exc))
                continue
            plans[list_name, index] = plan
            outcome.warnings.extend(w for w in plan.warnings if w not in outcome.warnings)
        return plans

    def _env_of(self, result: ContainerResult, plan: ClaimPlan | None) -> dict[str, str]:
        """The variables fracgpu puts in a container's spec, configured extras included. In DRA
        mode the grant's variables come from the node (the claim's CDI spec), which knows the
        card the claim got; the spec gets only the operator's extras."""
        if plan is not None:
            return dict(self.config.env)
        return self._granted_env(result.grant) if result.grant is not None else {}

    def _view(
        self,
        spec: Mapping[str, Any],
        meta: Mapping[str, Any],
        results: list[Located],
        gpu: bool,
        envs: Mapping[tuple[str, int], Mapping[str, str]],
    ) -> PodView:
        containers = tuple(
            Container.of(c, r, envs[list_name, index]) for list_name, index, c, r in results
        )
        return PodView.of(spec, meta, containers, gpu)

    @staticmethod
    def _claim_ops(
        ops: list[dict[str, Any]],
        root: str,
        spec: Mapping[str, Any],
        plans: Mapping[tuple[str, int], ClaimPlan],
    ) -> None:
        """The pod-level claims, one per GPU container, each made from its shared template."""
        present = spec.get("resourceClaims")
        have = (
            {str(c.get("name")) for c in present if isinstance(c, dict)}
            if isinstance(present, list)
            else set()
        )
        wanted = [
            {"name": pod_claim_name(list_name, index), "resourceClaimTemplateName": plan.name}
            for (list_name, index), plan in sorted(plans.items())
        ]
        missing = [claim for claim in wanted if claim["name"] not in have]
        if not missing:
            return
        if not isinstance(present, list):
            ops.append({"op": "add", "path": f"{root}/spec/resourceClaims", "value": missing})
        else:
            ops.extend(
                {"op": "add", "path": f"{root}/spec/resourceClaims/-", "value": c} for c in missing
            )

    def _container_ops(
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
            desired = self._granted_env(result.grant)
        else:
            return
        env = container.get("env")
        have = (
            {str(v.get("name")) for v in env if isinstance(v, dict)}
            if isinstance(env, list)
            else set()
        )
        missing = [{"name": k, "value": v} for k, v in desired.items() if k not in have]
        if not missing:
            return
        if not isinstance(env, list):
            ops.append({"op": "add", "path": f"{where}/env", "value": missing})
        else:
            ops.extend({"op": "add", "path": f"{where}/env/-", "value": v} for v in missing)

    def _scheduler_op(self, outcome: Outcome, spec: Mapping[str, Any]) -> None:
        """Hand a GPU pod to the configured scheduler, but only while it runs.

        Only pods, never templates: a template keeps its value for every pod made from it, and
        a scheduler that stops later would leave those pods waiting with no event. Each pod
        is decided when it is created.
        """
        scheduler = self.config.scheduler_name
        current = spec.get("schedulerName")
        if not (
            scheduler
            and current != scheduler
            and (current in (None, "", "default-scheduler") or self.config.override_scheduler)
        ):
            return
        why = self.scheduler.not_running() if self.scheduler is not None else None
        if why is not None:
            outcome.warnings.append(
                f"scheduler {scheduler} is not running ({why}); the pod keeps "
                f"{current or 'the default scheduler'} so that it does not wait unscheduled"
            )
            return
        op = "add" if current is None else "replace"
        outcome.patch.append({"op": op, "path": "/spec/schedulerName", "value": scheduler})

    def _pod_ops(self, ops: list[dict[str, Any]], pod: _Pod) -> None:
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
        self._annotation_op(ops, pod)

    @staticmethod
    def _annotation_op(ops: list[dict[str, Any]], pod: _Pod) -> None:
        root = pod.root
        annotations = pod.meta.get("annotations")
        present = annotations if isinstance(annotations, dict) else {}
        wanted = dict(pod.models.write)
        existing = present.get(REQUEST_ANNOTATION)
        asked = {
            r.name: r.request for *_, r in pod.results if r.grant is not None or r.ask is not None
        }
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


def _pod_priority(meta: Mapping[str, Any], errors: list[str]) -> Priority | None:
    """The pod's ``fracgpu.io/gpu-priority``, if it says one; a value that is none is an error."""
    annotations = meta.get("annotations")
    raw = annotations.get(PRIORITY_ANNOTATION) if isinstance(annotations, dict) else None
    if raw is None:
        return None
    try:
        return Priority(raw)
    except ValueError:
        errors.append(
            f"annotation {PRIORITY_ANNOTATION} must be high or low (the default); got "
            f"{quote(raw)}; high-priority shares borrow idle compute before low ones"
        )
        return None


def _policy_of(result: ContainerResult, pod_priority: Priority | None) -> SharePolicy:
    """A container's compute policy: bursting to its limit when it asked less in requests, at
    its own priority (HAMi's nvidia.com/priority) or the pod's; otherwise a hard cap."""
    ask = result.ask
    if ask is None or not ask.ceiling:
        return HARD_CAP
    return SharePolicy(ask.ceiling, ask.priority or pod_priority or Priority.LOW)


def model_expressions(chosen: ModelSet) -> list[dict[str, Any]]:
    """The node affinity expressions that keep a pod on the models it chose (device-plugin
    mode): the node label spells a product without spaces, so values are label-safe."""
    exprs: list[dict[str, Any]] = []
    if chosen.only:
        values = sorted({label_value(p) for p in chosen.only})
        exprs.append({"key": PRODUCT_LABEL, "operator": "In", "values": values})
    if chosen.excluded:
        values = sorted({label_value(p) for p in chosen.excluded})
        exprs.append({"key": PRODUCT_LABEL, "operator": "NotIn", "values": values})
    return exprs


def _same_expression(a: Mapping[str, Any], b: object) -> bool:
    if not isinstance(b, dict) or (a["key"], a["operator"]) != (b.get("key"), b.get("operator")):
        return False
    values = b.get("values")
    if not isinstance(values, list):
        return False
    return {model_key(v) for v in a["values"]} == {model_key(str(v)) for v in values}


def _affinity_op(
    ops: list[dict[str, Any]], root: str, spec: Mapping[str, Any], exprs: list[dict[str, Any]]
) -> None:
    """AND the expressions with the pod's required node affinity: selector terms are ORed and
    a term's expressions ANDed, so each term gets them (or one term is made). An expression a
    term already has (our earlier output) is not added again."""
    if not exprs:
        return
    affinity = spec.get("affinity")
    new: dict[str, Any] = copy.deepcopy(affinity) if isinstance(affinity, dict) else {}
    node = new.get("nodeAffinity")
    if not isinstance(node, dict):
        node = new["nodeAffinity"] = {}
    required = node.get(REQUIRED)
    if not isinstance(required, dict):
        required = node[REQUIRED] = {}
    terms = required.get("nodeSelectorTerms")
    if not isinstance(terms, list) or not terms:
        required["nodeSelectorTerms"] = [{"matchExpressions": list(exprs)}]
    else:
        for term in terms:
            if not isinstance(term, dict):
                continue  # the API server refuses the pod for it
            have = term.get("matchExpressions")
            if not isinstance(have, list):
                have = term["matchExpressions"] = []
            missing = [e for e in exprs if not any(_same_expression(e, h) for h in have)]
            have.extend(copy.deepcopy(missing))  # each term its own: the patch is JSON
    if new != affinity:
        ops.append({"op": "add", "path": f"{root}/spec/affinity", "value": new})


def _memo_key(
    name: str, resources: object, inputs: frozenset[str], choice_id: int
) -> tuple[Any, ...] | None:
    """What normalising a container depends on, or None when it cannot be remembered."""
    if not isinstance(resources, dict):
        return None if resources else (name, (), (), choice_id)
    limits, requests = resources.get("limits") or {}, resources.get("requests") or {}
    if not isinstance(limits, dict) or not isinstance(requests, dict):
        return None
    asked = tuple((k, v) for k, v in limits.items() if k in inputs)
    also = tuple((k, v) for k, v in requests.items() if k in inputs)
    for _, value in asked + also:
        if type(value) is not str:
            return None
    return (name, asked, also, choice_id)


def _keys(section: object) -> list[str]:
    return [str(k) for k in section] if isinstance(section, dict) else []


def respond(uid: str, outcome: Outcome) -> AdmissionResponse:
    if not outcome.allowed:
        return AdmissionResponse.deny(
            uid, outcome.message, code=422, reason="Invalid", label="invalid"
        )
    label = "gpu" if outcome.gpu else ("stripped" if outcome.patch else "no-gpu")
    return AdmissionResponse.allow(uid, outcome.patch, outcome.warnings, label=label)


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


def _claimed_env(spec: Mapping[str, Any]) -> dict[tuple[str, int], dict[str, str]]:
    """Containers already holding a claim from one of our templates (reinvocation, or a pod
    made from a workload admitted in DRA mode): GPU containers, whose spec carries no grant
    variable (the node sets them), so any FRACGPU_* in it is the user's and denied."""
    claims = spec.get("resourceClaims")
    templates = {
        str(c.get("name")): str(c.get("resourceClaimTemplateName") or "")
        for c in (claims if isinstance(claims, list) else ())
        if isinstance(c, dict)
    }
    found: dict[tuple[str, int], dict[str, str]] = {}
    for list_name in CONTAINER_LISTS:
        containers = spec.get(list_name)
        for index, container in enumerate(containers if isinstance(containers, list) else ()):
            resources = container.get("resources") if isinstance(container, dict) else None
            held = resources.get("claims") if isinstance(resources, dict) else None
            for claim in held if isinstance(held, list) else ():
                name = claim.get("name") if isinstance(claim, dict) else None
                if templates.get(str(name), "").startswith(TEMPLATE_PREFIX):
                    found[list_name, index] = {}
    return found
