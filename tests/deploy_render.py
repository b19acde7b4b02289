"""Renders the kustomize overlays in deploy/ once per test session, for the tests/test_deploy_*.py.

``kubectl kustomize`` is the renderer users run, so the tests use it too rather than a second
implementation; without kubectl on PATH the manifest tests are skipped and say why.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
OVERLAYS = ("default", "cert-manager", "dialects", "network-policy", "node-placement")
NAMESPACE = "fracgpu"

Obj = dict[str, Any]


def kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        pytest.skip(
            "kubectl is not on PATH: the manifest tests render deploy/ with kubectl kustomize"
        )
    return path


@functools.cache
def _render(overlay: str) -> tuple[str, str, int]:
    proc = subprocess.run(
        [kubectl(), "kustomize", str(DEPLOY / "overlays" / overlay)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return proc.stdout, proc.stderr, proc.returncode


def render(overlay: str) -> list[Obj]:
    """The objects an overlay renders to; fails the test with kustomize's error if it does not.

    Parsed once per session and shared: tests that change an object change a deep copy.
    """
    out, err, rc = _render(overlay)
    assert rc == 0, f"kubectl kustomize deploy/overlays/{overlay} failed:\n{err}"
    return _parse(out)


@functools.cache
def _parse(out: str) -> list[Obj]:
    return [doc for doc in yaml.safe_load_all(out) if doc]


def find(objs: list[Obj], kind: str, name: str) -> Obj:
    matches = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind} {name}, found {len(matches)}"
    return matches[0]


def of_kind(objs: list[Obj], kind: str) -> list[Obj]:
    return [o for o in objs if o["kind"] == kind]


def config_of(objs: list[Obj]) -> Obj:
    """The webhook's ``--config`` file, as the ConfigMap in the overlay carries it."""
    (cm,) = [
        o for o in of_kind(objs, "ConfigMap") if o["metadata"]["name"].startswith("fracgpu-config")
    ]
    data: Obj = yaml.safe_load(cm["data"]["config.yaml"])
    return data


def pod_specs(objs: list[Obj]) -> Iterator[tuple[Obj, Obj]]:
    """(workload, pod spec) for every Deployment and DaemonSet."""
    for obj in objs:
        if obj["kind"] in ("Deployment", "DaemonSet"):
            yield obj, obj["spec"]["template"]["spec"]


# What a ServiceAccount may do: (scope, API group, resource, name, verb), where scope is a
# namespace or "cluster" and name "*any*" when the rule names no resourceNames.
Grant = tuple[str, str, str, str, str]


def _expand(scope: str, rules: list[Obj]) -> set[Grant]:
    out: set[Grant] = set()
    for rule in rules:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for name in rule.get("resourceNames") or ["*any*"]:
                    for verb in rule["verbs"]:
                        out.add((scope, group, resource, name, verb))
    return out


def grants_of(objs: list[Obj], account: str) -> tuple[set[Grant], set[str]]:
    """What a ServiceAccount may do through roles in these objects, and the built-in roles it is
    bound to (by name, as 'cluster:NAME' or 'NAMESPACE:NAME')."""
    grants: set[Grant] = set()
    builtin: set[str] = set()
    for binding in of_kind(objs, "ClusterRoleBinding") + of_kind(objs, "RoleBinding"):
        subjects = binding.get("subjects") or []
        if not any(
            s["kind"] == "ServiceAccount" and s["name"] == account and s["namespace"] == NAMESPACE
            for s in subjects
        ):
            continue
        ref = binding["roleRef"]
        scope = binding["metadata"].get("namespace", "cluster")
        matches = [o for o in of_kind(objs, ref["kind"]) if o["metadata"]["name"] == ref["name"]]
        if not matches:
            builtin.add(f"{scope}:{ref['name']}")
            continue
        (role,) = matches
        grants |= _expand(scope, role["rules"])
    return grants, builtin


def policy_admits(policy: Obj, request: Obj, obj: Any, old_object: Any) -> bool:
    """Whether a ValidatingAdmissionPolicy lets a request through, evaluated as the API server
    does with cel-python: match conditions (a request they do not match is admitted), then the
    variables in order, then every validation."""
    import celpy

    env = celpy.Environment()

    def evaluate(expression: str, activation: dict[str, Any]) -> Any:
        return env.program(env.compile(expression)).evaluate(activation)

    activation: dict[str, Any] = {
        "request": celpy.json_to_cel(request),
        "object": celpy.json_to_cel(obj),
        "oldObject": celpy.json_to_cel(old_object),
    }
    for condition in policy["spec"].get("matchConditions") or []:
        if not bool(evaluate(condition["expression"], activation)):
            return True
    variables: dict[str, Any] = {}
    for variable in policy["spec"].get("variables") or []:
        variables[variable["name"]] = evaluate(
            variable["expression"], {**activation, "variables": celpy.json_to_cel(variables)}
        )
    activation["variables"] = celpy.json_to_cel({k: str(v) for k, v in variables.items()})
    return all(bool(evaluate(v["expression"], activation)) for v in policy["spec"]["validations"])


# --- the Helm chart ----------------------------------------------------------------------------

CHART = DEPLOY / "helm" / "fracgpu"
# Where `make helm` builds it (from the module proxy, at the version the project pins).
BUILT_HELM = ROOT / ".build" / "helm" / "helm"


def helm() -> str:
    """The helm binary: $FRACGPU_HELM, the one `make helm` built, or one on PATH."""
    import os

    for candidate in (os.environ.get("FRACGPU_HELM"), str(BUILT_HELM), shutil.which("helm")):
        if candidate and Path(candidate).is_file():
            return candidate
    pytest.skip("no helm: `make helm` builds it from the module proxy (needs Go)")


def helm_run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([helm(), *args], capture_output=True, text=True, timeout=120, check=False)


def template_args(
    values: Obj, *, namespace: str = NAMESPACE, kube: str = "1.35.0", apis: tuple[str, ...] = ()
) -> list[str]:
    """`helm template` arguments for ``values`` (written as one JSON --set-json per key) on a
    cluster of version ``kube`` that serves ``apis`` (helm's --api-versions)."""
    import json

    args = ["template", "fracgpu", str(CHART), "--namespace", namespace, "--kube-version", kube]
    args += [f"--api-versions={api}" for api in apis]
    for key, value in values.items():
        args += ["--set-json", f"{key}={json.dumps(value)}"]
    return args


def render_chart(values: Obj, **kwargs: Any) -> list[Obj]:
    """The objects the chart renders to (CRDs included); fails the test with helm's error."""
    proc = helm_run(*template_args(values, **kwargs), "--include-crds")
    assert proc.returncode == 0, f"helm template failed:\n{proc.stderr}"
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]
