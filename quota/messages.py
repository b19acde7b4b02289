"""Every message a user sees from GPU quota, in cards and MiB (design §4).

The basic denial is exactly the documented format:
``GPU quota exceeded in namespace "team-a": this pod asks 0.50 card and 8192 MiB; quota
"team-a" allows 4.00 cards (3.70 used) and 65536 MiB (61440 used)``.
"used" there is what the quota holds before this pod: pods the controller has counted plus
reservations of pods admitted but not yet counted. Only the limits the quota sets are named.
"""

from __future__ import annotations

from core.labels import PRODUCT_LABEL
from core.units import cards_phrase, cards_text
from quota.demand import Demand
from quota.ledger import Violation


def demand_phrase(demand: Demand) -> str:
    return f"{cards_phrase(demand.core)} and {demand.memory_mib} MiB"


def exceeded(violation: Violation) -> str:
    limit, charged, demand = violation.limit, violation.charged, violation.demand
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
            f"limit (pin it with nodeSelector {PRODUCT_LABEL} to count it against one model)"
        )
    return message


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
