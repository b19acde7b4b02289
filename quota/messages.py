"""Every message a user sees from GPU quota, in cards and MiB (design §4).

The basic denial is exactly the documented format:
``GPU quota exceeded in namespace "team-a": this pod asks 0.50 card and 8192 MiB; quota
"team-a" allows 4.00 cards (3.70 used) and 65536 MiB (61440 used)``.
"used" there is what the quota holds before this pod: pods the controller has counted plus
pods admitted but not yet seen by it. Only the limits the quota sets are named.
"""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING

from core.kube import GPUQUOTAS
from core.labels import MODEL_ANNOTATION, PRODUCT_LABEL
from core.units import cards_phrase, cards_text
from quota.demand import Demand
from quota.ledger import Violation

if TYPE_CHECKING:
    from quota.model import GPUQuota


def demand_phrase(demand: Demand) -> str:
    return f"{cards_phrase(demand.core)} and {demand.memory_mib} MiB"


def exceeded(violation: Violation) -> str:
    limit, charged, demand = violation.limit, violation.charged, violation.demand
    if demand.missing_claims:
        return unreadable_claims(violation)
    if demand.unsized_cards and limit.gpumem is not None:
        return unsized(violation)
    of = f" of {violation.model}" if violation.model else ""
    parts = []
    if limit.gpu is not None:
        noun = "card" if limit.gpu <= 100 else "cards"
        parts.append(f"{cards_text(limit.gpu)} {noun}{of} ({cards_text(charged.core)} used)")
    if limit.gpumem is not None:
        parts.append(f"{limit.gpumem} MiB{of} ({charged.memory_mib} used)")
    if limit.pods is not None:
        noun = "GPU pod" if limit.pods == 1 else "GPU pods"
        parts.append(f"{limit.pods} {noun}{of} ({charged.pods} used)")
    message = (
        f'GPU quota exceeded in namespace "{violation.namespace}": this pod asks '
        f'{demand_phrase(demand)}; quota "{violation.quota}" allows {" and ".join(parts)}'
    )
    if violation.model is not None and demand.models is None:
        message += (
            f"; the pod is not pinned to a GPU model, so it counts against every per-model "
            f"limit (pin it with nodeSelector {PRODUCT_LABEL}, or choose it with the annotation "
            f"{MODEL_ANNOTATION}, to count it against one model)"
        )
    return message


def unreadable_claims(violation: Violation) -> str:
    names = ", ".join(violation.demand.missing_claims)
    return (
        f'GPU quota cannot count this pod in namespace "{violation.namespace}": it uses '
        f"{names}, which does not exist (yet), so what it holds of a GPU is unknown while quota "
        f'"{violation.quota}" applies here; create the ResourceClaim before the pod, or name '
        f"fracgpu.io/gpu in the pod and let admission make the claim"
    )


def unsized(violation: Violation) -> str:
    cards = violation.demand.unsized_cards
    of = f" of {violation.model}" if violation.model else ""
    return (
        f'GPU quota cannot count this pod in namespace "{violation.namespace}": it asks '
        f"{cards} whole {'card' if cards == 1 else 'cards'}, which come with all of their "
        f"memory, and no GPU node of a model it may land on is known yet, while quota "
        f'"{violation.quota}" limits GPU memory{of} to {violation.limit.gpumem} MiB; create the '
        f"pod again once a GPU node has joined, or pin a GPU model with nodeSelector "
        f"{PRODUCT_LABEL} that the webhook's inventory.models names"
    )


def no_quota(namespace: str, demand: Demand) -> str:
    return (
        f'GPU quota required in namespace "{namespace}": this pod asks {demand_phrase(demand)}, '
        f"but the namespace has no GPUQuota and this cluster admits GPU pods only in namespaces "
        f'that have one; ask the cluster operator to create a GPUQuota in "{namespace}"'
    )


def unverifiable(namespace: str, demand: Demand, why: str) -> str:
    return (
        f'GPU quota could not be verified in namespace "{namespace}": {why}; this pod asks '
        f"{demand_phrase(demand)} and GPU pods are never admitted unaccounted. Retry in a "
        f"moment; if it persists, ask the cluster operator to check the Kubernetes API server "
        f"and the fracgpu webhook"
    )


def invalid_quota(namespace: str, error: str) -> str:
    return (
        f'GPU quota could not be applied in namespace "{namespace}": {error}; GPU pods are not '
        f"admitted until the GPUQuota is fixed"
    )


def not_counted(quota: GPUQuota) -> str:
    """Why a quota is not used yet (the reason behind :func:`not_counted_for`)."""
    why = (
        "its spec changed"
        if quota.status.observed_generation not in (None, quota.generation)
        else "it is new, or its status was reset"
    )
    return (
        f"GPUQuota {quota.ref} has not been counted yet ({why}): the fracgpu quota controller "
        f"first counts the GPU the namespace's existing pods hold, as soon as it sees the quota"
    )


def not_counted_for(namespace: str, demand: Demand, why: str) -> str:
    return (
        f'GPU quota not yet known in namespace "{namespace}": {why}; this pod asks '
        f"{demand_phrase(demand)} and GPU pods are never admitted against a quota whose usage "
        f"is unknown. Retry in a few seconds; if it persists, ask the cluster operator to check "
        f"that the fracgpu quota controller runs (kubectl get gpuquota shows Counted)"
    )


def controller_behind(since: datetime) -> str:
    """Appended to denials while admissions stay unmatched: usage may include ended pods."""
    return (
        f"; note: admissions since {since.strftime('%Y-%m-%dT%H:%M:%SZ')} have not been matched "
        f"to pods, so the fracgpu quota controller is not running and GPU that ended pods held "
        f"is still counted (operator: see docs/operator-guide.md, quota controller not running)"
    )


CRD_NAME = f"{GPUQUOTAS.plural}.{GPUQUOTAS.group}"
INSTALL_CRD = "kubectl apply -k deploy/crds"


def crd_missing_problem() -> str:
    """What an operator reads (log, `fracgpu serve` status) while the CRD is missing."""
    return (
        f"the GPUQuota CRD ({CRD_NAME}) is not installed, so no GPU quota can be checked and GPU "
        f"pods are denied; install it with `{INSTALL_CRD}` (from the fracgpu release)"
    )


def crd_missing(namespace: str, demand: Demand) -> str:
    return (
        f'GPU quota could not be checked in namespace "{namespace}": the GPUQuota CRD '
        f"({CRD_NAME}) is not installed in this cluster; this pod asks {demand_phrase(demand)} "
        f"and GPU pods are never admitted unaccounted. Ask the cluster operator to install it "
        f"with `{INSTALL_CRD}`"
    )
