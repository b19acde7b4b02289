"""What a pod may not set: one named-case table per check of webhook/checks.py."""

from __future__ import annotations

from typing import Any

import pytest

import webhook.checks
from core.units import Grant
from webhook.checks import (
    CHECKS,
    Check,
    Container,
    PodView,
    no_privileged_gpu_container,
    no_reserved_annotations,
    no_reserved_host_paths,
    no_reserved_mounts,
    no_system_env,
)
from webhook.config import AdmissionConfig
from webhook.resources import ContainerResult

SHARE = Grant(30, 95)


def container(name: str = "c", grant: Grant | None = SHARE, **spec: Any) -> Container:
    granted = grant.env() if grant else {}
    return Container({"name": name, **spec}, ContainerResult(name, grant=grant), granted)


def view(
    *containers: Container,
    volumes: list[Any] | None = None,
    annotations: dict[str, Any] | None = None,
) -> PodView:
    spec: dict[str, Any] = {"containers": [c.spec for c in containers]}
    if volumes is not None:
        spec["volumes"] = volumes
    meta: dict[str, Any] = {} if annotations is None else {"annotations": annotations}
    gpu = any(c.result.grant is not None for c in containers)
    return PodView(spec, meta, containers, gpu)


def problems(check: Check, pod: PodView, **config: Any) -> list[str]:
    return list(check(pod, AdmissionConfig(**config)))


def env(name: str, value: Any = None, **extra: Any) -> dict[str, Any]:
    var: dict[str, Any] = {"name": name, **extra}
    if value is not None:
        var["value"] = value
    return var


VISIBLE = (
    'container "c": environment variable NVIDIA_VISIBLE_DEVICES selects GPUs and is set only by '
    "the fracgpu device plugin; remove it and request fracgpu.io/gpu instead"
)


def system(name: str, shown: str) -> str:
    return (
        f'container "c": environment variable {name} is set by fracgpu and cannot be set in the '
        f"pod spec (got {shown}); remove it"
    )


@pytest.mark.parametrize(
    ("variables", "grant", "expected"),
    [
        pytest.param([env("NVIDIA_VISIBLE_DEVICES", "all")], SHARE, [VISIBLE], id="visible-all"),
        pytest.param([env("NVIDIA_VISIBLE_DEVICES", "0")], None, [VISIBLE], id="visible-no-gpu"),
        pytest.param(
            [env("NVIDIA_VISIBLE_DEVICES", valueFrom={"fieldRef": {}})],
            None,
            [VISIBLE],
            id="visible-from-a-field",
        ),
        pytest.param([env("NVIDIA_VISIBLE_DEVICES", "void")], None, [], id="visible-void"),
        pytest.param([env("NVIDIA_VISIBLE_DEVICES", "none")], SHARE, [], id="visible-none"),
        pytest.param([env("NVIDIA_VISIBLE_DEVICES", "")], SHARE, [], id="visible-empty"),
        pytest.param([env("FRACGPU_GPU", "0.3")], SHARE, [], id="grant-own-value"),
        pytest.param([env("FRACGPU_MEMORY_MIB", "24320")], SHARE, [], id="grant-own-memory-value"),
        pytest.param(
            [env("FRACGPU_GPU", "1")], SHARE, [system("FRACGPU_GPU", '"1"')], id="grant-other"
        ),
        pytest.param(
            [env("FRACGPU_GPU", "0.3")],
            None,
            [system("FRACGPU_GPU", '"0.3"')],
            id="grant-value-without-a-grant",
        ),
        pytest.param(
            [env("FRACGPU_MEMORY_MIB", "81408")],
            Grant(200, 0),
            [system("FRACGPU_MEMORY_MIB", '"81408"')],
            id="memory-on-whole-cards-is-the-nodes",
        ),
        pytest.param(
            [env("FRACGPU_DISABLE", "1")], SHARE, [system("FRACGPU_DISABLE", '"1"')], id="other"
        ),
        pytest.param(
            [env("FRACGPU_GPU", valueFrom={"secretKeyRef": {}})],
            SHARE,
            [system("FRACGPU_GPU", "null")],
            id="grant-from-a-secret",
        ),
        pytest.param([env("PATH", "/bin"), "junk"], SHARE, [], id="ordinary"),
    ],
)
def test_no_system_env(variables: list[Any], grant: Grant | None, expected: list[str]) -> None:
    assert problems(no_system_env, view(container(grant=grant, env=variables))) == expected


PRIVILEGED = (
    'container "c": is privileged; a privileged container sees every GPU of the node and escapes '
    "its share; remove securityContext.privileged from GPU pods"
)


@pytest.mark.parametrize(
    ("pod", "config", "expected"),
    [
        pytest.param(
            view(container(securityContext={"privileged": True})), {}, [PRIVILEGED], id="gpu"
        ),
        pytest.param(
            view(
                container("app"),
                container(grant=None, securityContext={"privileged": True}),
            ),
            {},
            [PRIVILEGED],
            id="sidecar-of-a-gpu-pod",
        ),
        pytest.param(
            view(container(grant=None, securityContext={"privileged": True})),
            {},
            [],
            id="no-gpu-pod",
        ),
        pytest.param(
            view(container(securityContext={"privileged": True})),
            {"allow_privileged": True},
            [],
            id="allowed-by-the-operator",
        ),
        pytest.param(
            view(container(securityContext={"privileged": False})), {}, [], id="not-privileged"
        ),
        pytest.param(
            view(container(securityContext={"privileged": "true"})), {}, [], id="not-a-boolean"
        ),
    ],
)
def test_no_privileged_gpu_container(
    pod: PodView, config: dict[str, Any], expected: list[str]
) -> None:
    assert problems(no_privileged_gpu_container, pod, **config) == expected


def mounted(*paths: Any, grant: Grant | None = SHARE) -> PodView:
    return view(container(grant=grant, volumeMounts=[{"name": "v", "mountPath": p} for p in paths]))


@pytest.mark.parametrize(
    ("pod", "denied"),
    [
        pytest.param(mounted("/etc/ld.so.preload"), ["/etc/ld.so.preload"], id="preload"),
        pytest.param(mounted("/run/fracgpu"), ["/run/fracgpu"], id="limits-root"),
        pytest.param(
            mounted("/run/fracgpu/limits/../limits/"),
            ["/run/fracgpu/limits/../limits/"],
            id="dot-dot-and-trailing-slash",
        ),
        pytest.param(mounted("//usr/local/fracgpu"), ["//usr/local/fracgpu"], id="double-slash"),
        pytest.param(mounted("/run/fracgpu-other", "/data"), [], id="look-alike"),
        pytest.param(mounted("/etc/ld.so.preload", grant=None), [], id="no-gpu-pod"),
        pytest.param(mounted(42), [], id="not-a-path"),
    ],
)
def test_no_reserved_mounts(pod: PodView, denied: list[str]) -> None:
    assert [p.split(" covers")[0] for p in problems(no_reserved_mounts, pod)] == [
        f'container "c": volume mount at {path}' for path in denied
    ]


def host(path: Any, grant: Grant | None = SHARE) -> PodView:
    return view(container(grant=grant), volumes=[{"name": "v", "hostPath": {"path": path}}])


@pytest.mark.parametrize(
    ("pod", "expected"),
    [
        pytest.param(
            host("/var/lib/fracgpu/containers"),
            [
                'volume "v": hostPath /var/lib/fracgpu/containers holds fracgpu\'s node state '
                "(/var/lib/fracgpu) and cannot be mounted into a GPU pod; remove it"
            ],
            id="under-the-state",
        ),
        pytest.param(host("/var/lib/fracgpu-old"), [], id="look-alike"),
        pytest.param(host("/data"), [], id="elsewhere"),
        pytest.param(host("/var/lib/fracgpu", grant=None), [], id="no-gpu-pod"),
    ],
)
def test_no_reserved_host_paths(pod: PodView, expected: list[str]) -> None:
    assert problems(no_reserved_host_paths, pod) == expected


@pytest.mark.parametrize(
    ("annotations", "grant", "expected"),
    [
        pytest.param(
            {"fracgpu.io/unlimited": "true"},
            SHARE,
            [
                "annotation fracgpu.io/unlimited is reserved for fracgpu and cannot be set on a "
                "GPU pod; remove it"
            ],
            id="reserved",
        ),
        pytest.param({"fracgpu.io/request": "{}"}, SHARE, [], id="the-request-record"),
        pytest.param({"example.com/fracgpu.io": "x"}, SHARE, [], id="look-alike"),
        pytest.param({"fracgpu.io/unlimited": "true"}, None, [], id="no-gpu-pod"),
    ],
)
def test_no_reserved_annotations(
    annotations: dict[str, str], grant: Grant | None, expected: list[str]
) -> None:
    pod = view(container(grant=grant), annotations=annotations)
    assert problems(no_reserved_annotations, pod) == expected


def test_every_check_is_registered() -> None:
    """A rule written but not added to the registry would never run."""
    defined = {
        name
        for name, obj in vars(webhook.checks).items()
        if name.startswith("no_") and callable(obj)
    }
    assert {c.__name__ for c in CHECKS} == defined
