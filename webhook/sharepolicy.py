"""Each GPU container's compute policy: a hard cap, or a guarantee that may burst, and at what
priority.

A share bursts to its limit when it asked less ``fracgpu.io/gpu`` in requests than in limits
(or HAMi's ``nvidia.com/priority`` said so); the pod's ``fracgpu.io/gpu-priority`` annotation
orders the shares that borrow idle compute. Device-plugin mode writes the policies in the pod's
policy annotation, DRA mode in each claim's configuration (``webhook.claims``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from core.policy import HARD_CAP, PRIORITY_ANNOTATION, Priority, SharePolicy
from webhook.podwalk import Located, Where
from webhook.resources import ContainerResult
from webhook.wording import quote


def share_policies(
    meta: Mapping[str, Any], results: list[Located], errors: list[str], warnings: list[str]
) -> dict[Where, SharePolicy]:
    """The policy of each container; a priority that is none is added to ``errors``, and one
    that cannot matter (no share of the pod may burst) is warned about."""
    priority = _pod_priority(meta, errors)
    policies = {
        (list_name, index): policy_of(result, priority) for list_name, index, _, result in results
    }
    asked = any(r.ask is not None and not r.ask.exact for *_, r in results)
    # Only where the request is read: a pod made from a mutated template carries its
    # policy already, and says nothing of a burst in its canonical resources.
    if priority is not None and asked and not any(p.ceiling for p in policies.values()):
        warnings.append(
            f"annotation {PRIORITY_ANNOTATION}: {priority} has no effect: priority orders "
            f"the shares that borrow idle compute, and no share of this pod may burst; ask "
            f"less fracgpu.io/gpu in requests than in limits to let a share burst"
        )
    return policies


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


def policy_of(result: ContainerResult, pod_priority: Priority | None) -> SharePolicy:
    """A container's compute policy: bursting to its limit when it asked less in requests, at
    its own priority (HAMi's nvidia.com/priority) or the pod's; otherwise a hard cap."""
    ask = result.ask
    if ask is None or not ask.ceiling:
        return HARD_CAP
    return SharePolicy(ask.ceiling, ask.priority or pod_priority or Priority.LOW)
