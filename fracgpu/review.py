"""``fracgpu review``: the webhook's decision on manifests, offline, without a cluster.

The same :class:`~webhook.mutation.Mutator` the server runs is applied to every Pod and workload
in the files, so what ``review`` says is what the cluster will do (given the same
configuration and GPU inventory).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import jsonpatch
import yaml

from core.labels import ModelSet
from webhook.inventory import Inventory
from webhook.mutation import TEMPLATE_PATHS, Mutator


class ManifestError(ValueError):
    """A file that cannot be read as Kubernetes manifests."""


@dataclass
class Decision:
    source: str
    kind: str
    name: str
    allowed: bool
    message: str = ""
    warnings: list[str] = field(default_factory=list)
    object: dict[str, Any] | None = None
    mutated: bool = False
    models: str = ""  # the GPU models the pod chose, as admission honours them

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "kind": self.kind,
            "name": self.name,
            "allowed": self.allowed,
            "message": self.message,
            "warnings": self.warnings,
            "models": self.models or None,
            "object": self.object,
        }


def read_manifests(paths: Iterable[str]) -> Iterator[tuple[str, Any]]:
    """Yield (source, object) for every document, expanding ``kind: List``."""
    for path in paths:
        if path == "-":
            text, source = sys.stdin.read(), "<stdin>"
        else:
            try:
                text, source = Path(path).read_text(), path
            except OSError as exc:
                raise ManifestError(f"{path}: {exc.strerror or exc}") from None
        try:
            documents = list(yaml.safe_load_all(text))
        except yaml.YAMLError as exc:
            raise ManifestError(f"{source}: not YAML or JSON: {exc}") from None
        except ValueError:
            # PyYAML turns a plain number into an int, which Python refuses past 4,300 digits.
            raise ManifestError(
                f"{source}: holds a number too long to read (more than 4300 digits); "
                f"no Kubernetes quantity is that long"
            ) from None
        for index, doc in enumerate(documents):
            if doc is None:
                continue
            where = f"{source}#{index + 1}" if len(documents) > 1 else source
            if isinstance(doc, dict) and doc.get("kind") == "List":
                for item in doc.get("items") or []:
                    yield where, item
            else:
                yield where, doc


def review_object(mutator: Mutator, source: str, obj: Any) -> Decision:
    if not isinstance(obj, dict):
        return Decision(source, "?", "?", False, "not a Kubernetes object (expected a mapping)")
    api_version = str(obj.get("apiVersion") or "")
    kind = str(obj.get("kind") or "")
    meta = obj.get("metadata") if isinstance(obj.get("metadata"), dict) else {}
    assert isinstance(meta, dict)
    name = str(meta.get("name") or meta.get("generateName") or "<unnamed>")
    group = api_version.rpartition("/")[0] if "/" in api_version else ""
    if (group, kind) not in TEMPLATE_PATHS:
        return Decision(source, kind, name, True, "not a Pod or workload; unchanged", object=obj)
    outcome = mutator.mutate(obj, group, kind)
    if not outcome.allowed:
        return Decision(source, kind, name, False, outcome.message, outcome.warnings)
    mutated = jsonpatch.apply_patch(obj, outcome.patch) if outcome.patch else obj
    return Decision(
        source,
        kind,
        name,
        True,
        "",
        outcome.warnings,
        mutated,
        mutated=bool(outcome.patch),
        models=describe_models(outcome.models),
    )


def describe_models(models: ModelSet | None) -> str:
    """The GPU models a pod may get, as a person reads them."""
    if models is None:
        return ""
    if models.only is not None:
        return f"only {', '.join(sorted(models.only))}"
    return f"any but {', '.join(sorted(models.excluded))}"


def apply_quota(decisions: list[Decision], quota_file: Path, inventory: Inventory) -> None:
    """Check the admitted Pods against GPUQuotas from a file, in order, as the server would.

    Workloads are not charged: their pods are, when they are created.
    """
    from quota.model import QuotaError
    from quota.offline import review_pods

    admitted = [d for d in decisions if d.allowed and d.kind == "Pod" and d.object is not None]
    try:
        verdicts = review_pods(
            quota_file,
            [d.object for d in admitted if d.object is not None],
            card_memory=inventory.largest_card_mib,
        )
    except (OSError, QuotaError) as exc:
        raise ManifestError(str(exc)) from None
    for decision, verdict in zip(admitted, verdicts, strict=True):
        if not verdict.allowed:
            decision.allowed = False
            decision.message = verdict.message
            decision.object = None


def render_text(decisions: list[Decision], out: TextIO) -> None:
    """Mutated objects as YAML (ready for ``kubectl apply -f -``), decisions as comments."""
    for d in decisions:
        head = f"# {d.kind}/{d.name} ({d.source}): "
        if not d.allowed:
            out.write(f"{head}DENIED\n#   {d.message}\n")
            for w in d.warnings:
                out.write(f"#   warning: {w}\n")
            continue
        out.write(head + ("allowed, mutated" if d.mutated else "allowed, unchanged"))
        out.write(f"; {d.message}\n" if d.message else "\n")
        if d.models:
            out.write(f"#   GPU models: {d.models}\n")
        for w in d.warnings:
            out.write(f"#   warning: {w}\n")
        out.write("---\n")
        out.write(yaml.safe_dump(d.object, sort_keys=False))


def render_json(decisions: list[Decision], out: TextIO) -> None:
    json.dump([d.to_json() for d in decisions], out, indent=2)
    out.write("\n")
