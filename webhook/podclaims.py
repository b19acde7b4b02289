"""DRA mode's rewrite of a pod: each GPU container names a pod claim made from a template.

``webhook.claims`` decides what each container's template says; this module is the pod side:
which containers already hold a claim from one of our templates, the plan of each GPU
container's claim, and the pod-level ``resourceClaims`` entries the patch adds. Making sure the
templates exist is ``Templates``' (``webhook.claimstore``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from core.labels import ModelSet
from core.policy import SharePolicy
from webhook.claims import TEMPLATE_PREFIX, ClaimPlan, plan_claim, pod_claim_name, with_policy
from webhook.gpumodels import GpuModel
from webhook.parsing import RequestError
from webhook.podwalk import Located, Where, containers


class Templates(Protocol):
    """Makes sure a claim template exists in a namespace (DRA mode; ``webhook.claimstore``).
    Raises TemplateError when it cannot."""

    async def ensure(self, namespace: str, plan: ClaimPlan, *, dry_run: bool) -> None: ...


def plan_claims(
    results: list[Located],
    known: Mapping[str, GpuModel],
    chosen: ModelSet | None,
    policies: Mapping[Where, SharePolicy],
    *,
    max_cards: int,
    errors: list[str],
    warnings: list[str],
) -> dict[Where, ClaimPlan]:
    """The claim template each GPU container's claim is made from, with its share's policy
    (only the models the pod chose, if it did). A request no model can hold is added to
    ``errors``; the plans' warnings, each once, to ``warnings``."""
    models = {
        product: card for product, card in known.items() if chosen is None or product in chosen
    }
    plans: dict[Where, ClaimPlan] = {}
    for list_name, index, _, result in results:
        if result.ask is None:
            continue
        try:
            plan = plan_claim(
                result.name,
                result.ask,
                models,
                max_cards=max_cards,
                chosen=chosen,
            )
        except RequestError as exc:
            errors.append(str(exc))
            continue
        plans[list_name, index] = plan
        warnings.extend(w for w in plan.warnings if w not in warnings)
    return {key: with_policy(plan, policies[key]) for key, plan in plans.items()}


def claim_ops(
    ops: list[dict[str, Any]],
    root: str,
    spec: Mapping[str, Any],
    plans: Mapping[Where, ClaimPlan],
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


def claimed_env(spec: Mapping[str, Any]) -> dict[Where, dict[str, str]]:
    """Containers already holding a claim from one of our templates (reinvocation, or a pod
    made from a workload admitted in DRA mode): GPU containers, whose spec carries no grant
    variable (the node sets them), so any FRACGPU_* in it is the user's and denied."""
    claims = spec.get("resourceClaims")
    templates = {
        str(c.get("name")): str(c.get("resourceClaimTemplateName") or "")
        for c in (claims if isinstance(claims, list) else ())
        if isinstance(c, dict)
    }
    found: dict[Where, dict[str, str]] = {}
    for list_name, index, container in containers(spec):
        resources = container.get("resources")
        held = resources.get("claims") if isinstance(resources, dict) else None
        for claim in held if isinstance(held, list) else ():
            name = claim.get("name") if isinstance(claim, dict) else None
            if templates.get(str(name), "").startswith(TEMPLATE_PREFIX):
                found[list_name, index] = {}
    return found
