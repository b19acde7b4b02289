"""What a GPU pod may not set when its card is chosen by fracgpu's scheduler extender.

With ``admission.placement: extender`` (device-plugin mode) the card of every GPU pod is chosen
by the extender of the scheduler ``admission.scheduler_name`` names, booked on the node's ledger
and recorded on the pod by the Binding itself (``fracgpu.io/placement``, docs/design/
extender-memo.md §2.7). The guarantee that kubelet never refuses such a pod rests on every GPU
pod passing through that bind. Two things in a pod's spec skip it, and both are denied here,
for a Pod and for a workload's pod template alike (a template's pods would all be denied):

- ``spec.nodeName`` preset: the pod is bound at creation, by nobody's scheduler, with no card
  booked or recorded;
- ``spec.schedulerName`` naming another scheduler (other than ``default-scheduler``, which
  admission replaces): that scheduler binds it without a record. With
  ``admission.override_scheduler`` admission replaces it instead, as it always has.

A mirror pod (kubelet's copy of a static pod, which runs on its node whatever the API server
says) keeps its ``spec.nodeName``: refusing it would only hide the pod, and nobody could follow
the advice to remove the field.

The node still never overcommits a card for such a pod (it places a pod without a record by its
own best fit, or waits), but the extender does not know about it and may book the same
capacity, so the pod it then binds waits; refusing at admission says why at once instead.

Kept apart from :mod:`webhook.checks`, whose rules also judge a running pod when kubectl debug
adds an ephemeral container to it: a bound pod has ``spec.nodeName`` by then, rightly.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from webhook.config import AdmissionConfig
from webhook.podpatch import DEFAULT_SCHEDULERS
from webhook.wording import quote

MIRROR_ANNOTATION = "kubernetes.io/config.mirror"
"""What kubelet writes on the mirror pod of a static pod."""


def scheduling_problems(
    spec: Mapping[str, Any],
    meta: Mapping[str, Any],
    config: AdmissionConfig,
    base: tuple[str, ...] = (),
) -> list[str]:
    """The denials for a GPU pod (or the pod template at ``base`` in its object) that would
    skip the extender; none unless extender placement is on."""
    if not config.extender_placement:
        return []
    scheduler = config.scheduler_name
    field = ".".join((*base, "spec"))
    problems: list[str] = []
    node = spec.get("nodeName")
    annotations = meta.get("annotations")
    mirror = isinstance(annotations, dict) and MIRROR_ANNOTATION in annotations
    if node not in (None, "") and not mirror:
        problems.append(
            f"{field}.nodeName is set ({quote(node)}): GPU pods are placed by scheduler "
            f"{scheduler}, whose extender books the pod's card and records it as it binds the "
            f"pod (admission.placement: extender); a pod created bound skips it, with no card "
            f"booked or recorded; remove {field}.nodeName (to keep the pod on one node, use a "
            f"nodeSelector on kubernetes.io/hostname)"
        )
    current = spec.get("schedulerName")
    if current not in (*DEFAULT_SCHEDULERS, scheduler) and not config.override_scheduler:
        problems.append(
            f"{field}.schedulerName is {quote(current)}: GPU pods are scheduled by {scheduler}, "
            f"whose extender books the pod's card and records it as it binds the pod "
            f"(admission.placement: extender); another scheduler would bind it with no card "
            f"recorded; remove {field}.schedulerName or set it to {scheduler}"
        )
    return problems
