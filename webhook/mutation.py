"""Mutation of GPU pods and of the pod templates of built-in workloads (design §3).

For each object the webhook either denies with every problem named, or returns a JSON patch
built against the exact JSON the apiserver sent: the request rewritten into the canonical form,
the original recorded in an annotation, scheduler, tolerations and environment added, and a
GPU model the pod chose in its annotations honoured. Applying the mutation to its own output
changes nothing (reinvocation is a no-op), and objects that ask for no GPU pass untouched.

``Mutator`` runs the steps in order; each has its module: normalising every container
(``webhook.normaliser``), the models the pod chose (``webhook.podmodels``), each share's
compute policy (``webhook.sharepolicy``), DRA mode's claims (``webhook.podclaims``), the checks
(``webhook.checks``; with extender placement also ``webhook.scheduling``), and the patch
operations both modes share (``webhook.podpatch``). This module decides which apply, and answers
kubectl debug's ephemeral containers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from core.admission import AdmissionRequest, AdmissionResponse
from core.labels import ModelSet
from core.placement import PLACEMENT_ANNOTATION
from core.policy import SharePolicy, encode_annotation
from webhook.checks import Container, PodView, forbidden
from webhook.claims import ClaimPlan, TemplateError, pod_claim_name
from webhook.config import AdmissionConfig
from webhook.dialects import Dialect, enabled
from webhook.gpumodels import GpuModel
from webhook.inventory import Inventory
from webhook.normaliser import ContainerNormaliser
from webhook.podclaims import Templates, claim_ops, claimed_env, plan_claims
from webhook.podmodels import PodModelReader, affinity_op, model_expressions
from webhook.podpatch import PodPatcher, PodTarget, SchedulerCheck, pointer
from webhook.podwalk import EPHEMERAL_CONTAINERS, Located, Where, containers, resource_keys
from webhook.resources import ContainerResult
from webhook.scheduling import scheduling_problems
from webhook.sharepolicy import share_policies
from webhook.wording import container_ref

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
EPHEMERAL = "ephemeralcontainers"  # the Pod subresource kubectl debug writes
DENY_LIMIT = 8  # problems listed in one denial; more would be truncated by kubectl anyway


@dataclass
class MutationOutcome:
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
        claim_models: Callable[[], Mapping[str, GpuModel]] | None = None,
        templates: Templates | None = None,
    ) -> None:
        self.config = config
        self.inventory = inventory
        # DRA mode: claims sized per GPU model the cluster's ResourceSlices publish.
        self.dra = config.allocation == "dra"
        self.claim_models = claim_models or inventory.models
        self.templates = templates
        dialects = enabled(config.dialects)
        self.normaliser = ContainerNormaliser(config, dialects, sized=not self.dra)
        self.inputs = self.normaliser.inputs
        self.models = PodModelReader(
            self.claim_models if self.dra else inventory.models,
            self.inputs,
            hami=Dialect.HAMI in dialects,
        )
        self.patcher = PodPatcher(config, self.inputs, scheduler)

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
        see every card), and nothing else of the pod, admitted at its creation, is changed (the
        subresource keeps the rest of the stored pod, whatever the request carries)."""
        pod = req.object if isinstance(req.object, dict) else {}
        outcome = self.mutate_pod(pod, running=True)
        if not outcome.allowed:
            return respond(req.uid, outcome)
        return AdmissionResponse.allow(req.uid, label="ephemeral")

    def mutate(self, obj: Mapping[str, Any], group: str, kind: str) -> MutationOutcome:
        """Mutate an object of a supported kind; other kinds pass untouched."""
        path = TEMPLATE_PATHS.get((group, kind))
        if path is None:
            return MutationOutcome()
        template: Any = obj
        for token in path:
            template = template.get(token) if isinstance(template, dict) else None
        if not isinstance(template, dict):
            return MutationOutcome()
        return self.mutate_pod(template, path)

    def mutate_pod(
        self, pod: Mapping[str, Any], base: tuple[str, ...] = (), *, running: bool = False
    ) -> MutationOutcome:
        """Mutate a Pod, or a pod template found at ``base`` inside its object. ``running``: a
        pod already admitted and bound (kubectl debug's), whose node and placement record were
        set by its scheduler, not by its creator."""
        outcome = MutationOutcome()
        spec = pod.get("spec")
        if not isinstance(spec, dict):
            return outcome
        raw_meta = pod.get("metadata")
        meta: Mapping[str, Any] = raw_meta if isinstance(raw_meta, dict) else {}
        models = self.models.read(spec, meta)
        choice = self.inventory.choose(spec, models.chosen)
        results = self.normaliser.pod(spec, choice, outcome.errors, outcome.warnings)
        claimed = claimed_env(spec)
        if any(r.mentions_gpu for *_, r in results) or claimed:
            outcome.errors.extend(models.errors)  # a pod with no GPU gets no model either
        policies = share_policies(meta, results, outcome.errors, outcome.warnings)
        plans: dict[Where, ClaimPlan] = {}
        if self.dra:
            plans = plan_claims(
                results,
                self.claim_models(),
                models.chosen,
                policies,
                max_cards=self.config.max_cards,
                errors=outcome.errors,
                warnings=outcome.warnings,
            )
        outcome.gpu = any(r.grant is not None for *_, r in results) or bool(plans)
        if running:
            meta = _without_record(meta)
        envs = self._check(spec, meta, results, plans=plans, claimed=claimed, outcome=outcome)
        if outcome.gpu and not running:
            outcome.errors.extend(scheduling_problems(spec, meta, self.config, base))
        if outcome.errors:
            outcome.warnings.clear()
            return outcome
        if any(r.mentions_gpu for *_, r in results):
            root = pointer(*base) if base else ""
            target = PodTarget(root, spec, meta, isinstance(raw_meta, dict), results, models)
            self._patch(outcome, target, plans, envs, policies, template=bool(base))
        return outcome

    def _check(
        self,
        spec: Mapping[str, Any],
        meta: Mapping[str, Any],
        results: list[Located],
        *,
        plans: Mapping[Where, ClaimPlan],
        claimed: Mapping[Where, Mapping[str, str]],
        outcome: MutationOutcome,
    ) -> dict[Where, Mapping[str, str]]:
        """What the pod may not set (``webhook.checks``), seen with the variables admission
        gives each container, ephemeral ones included; those variables, for the patch."""
        checked = results + _ephemeral_containers(spec, self.inputs, outcome.errors)
        envs: dict[Where, Mapping[str, str]] = {
            (list_name, index): self.patcher.env_of(result, plans.get((list_name, index)))
            or claimed.get((list_name, index), {})
            for list_name, index, _, result in checked
        }
        views = tuple(
            Container.of(c, r, envs[list_name, index]) for list_name, index, c, r in checked
        )
        view = PodView.of(spec, meta, views, outcome.gpu or bool(claimed))
        outcome.errors.extend(forbidden(view, self.config))
        return envs

    def _patch(
        self,
        outcome: MutationOutcome,
        pod: PodTarget,
        plans: Mapping[Where, ClaimPlan],
        envs: Mapping[Where, Mapping[str, str]],
        policies: Mapping[Where, SharePolicy],
        *,
        template: bool,
    ) -> None:
        """The operations, in order: each GPU container's (DRA mode: its claim), the pod's
        claims, then for a GPU pod its model affinity (device-plugin mode), tolerations,
        annotations and (a Pod, not a template) its scheduler."""
        ops = outcome.patch
        for list_name, index, container, result in pod.results:
            where = f"{pod.root}/spec/{list_name}/{index}"
            if (list_name, index) in plans:
                claim = pod_claim_name(list_name, index)
                env = envs[list_name, index]
                self.patcher.container_ops(
                    ops, where, container, result, claim=claim, claim_env=env
                )
            elif result.mentions_gpu or result.grant is not None:
                self.patcher.container_ops(ops, where, container, result)
        if plans:
            claim_ops(ops, pod.root, pod.spec, plans)
            outcome.templates = list({plan.name: plan for plan in plans.values()}.values())
        if not outcome.gpu:
            return
        chosen = outcome.models = pod.models.chosen
        policy = (
            None
            if plans
            else encode_annotation({r.name: policies[ln, ix] for ln, ix, _, r in pod.results})
        )
        if chosen is not None and not plans:
            affinity_op(ops, pod.root, pod.spec, model_expressions(chosen))
        self.patcher.pod_ops(ops, replace(pod, policy=policy))
        if not template:
            self.patcher.scheduler_op(ops, outcome.warnings, pod.spec)


def _ephemeral_containers(
    spec: Mapping[str, Any], inputs: frozenset[str], errors: list[str]
) -> list[Located]:
    """Ephemeral containers hold no resources; they are only checked, never rewritten."""
    found: list[Located] = []
    for _, index, container in containers(spec, (EPHEMERAL_CONTAINERS,)):
        name = str(container.get("name") or f"{EPHEMERAL_CONTAINERS}[{index}]")
        resources = container.get("resources")
        asked = sorted(
            key
            for part in ("limits", "requests")
            for key in resource_keys(resources.get(part) if isinstance(resources, dict) else None)
            if key in inputs
        )
        if asked:
            errors.append(
                f"{container_ref(name)}: is an ephemeral container and asks for "
                f"{', '.join(asked)}; ephemeral containers get no GPU, remove the resources"
            )
        found.append((EPHEMERAL_CONTAINERS, index, container, ContainerResult(name)))
    return found


def _without_record(meta: Mapping[str, Any]) -> Mapping[str, Any]:
    """A bound pod's metadata without the placement record its Binding wrote, which the checks
    refuse only from a pod's creator (``webhook.checks.no_reserved_annotations``)."""
    annotations = meta.get("annotations")
    if not isinstance(annotations, dict) or PLACEMENT_ANNOTATION not in annotations:
        return meta
    kept = {k: v for k, v in annotations.items() if k != PLACEMENT_ANNOTATION}
    return {**meta, "annotations": kept}


def respond(uid: str, outcome: MutationOutcome) -> AdmissionResponse:
    if not outcome.allowed:
        return AdmissionResponse.deny(
            uid, outcome.message, code=422, reason="Invalid", label="invalid"
        )
    label = "gpu" if outcome.gpu else ("stripped" if outcome.patch else "no-gpu")
    return AdmissionResponse.allow(uid, outcome.patch, outcome.warnings, label=label)
