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
    no_cdi_annotations,
    no_device_list_mounts,
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
    return Container.of({"name": name, **spec}, ContainerResult(name, grant=grant), granted)


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
    return PodView.of(spec, meta, containers, gpu)


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


def holds(path: str, what: str, guard: str) -> str:
    return (
        f'volume "v": hostPath {path} holds {what} ({guard}) and cannot be mounted into a GPU '
        f"pod; remove it"
    )


def contains(path: str, what: str, guard: str) -> str:
    return (
        f'volume "v": hostPath {path} contains {what} ({guard}) and cannot be mounted into a GPU '
        f"pod; mount a narrower path"
    )


STATE = "fracgpu's node state"
PLUGINS = "kubelet's device plugin sockets"
PROCESSES = (
    'volume "v": hostPath {} exposes the node\'s processes, and through them every path of the '
    "node, and cannot be mounted into a GPU pod; remove it"
)


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
        pytest.param(
            host("/proc/1/root/var/lib/fracgpu"),
            [
                holds(
                    "/proc/1/root/var/lib/fracgpu (the node's /var/lib/fracgpu)",
                    STATE,
                    "/var/lib/fracgpu",
                )
            ],
            id="through-pid-1-root",
        ),
        pytest.param(
            host("/proc/self/root/var/lib/fracgpu/"),
            [
                holds(
                    "/proc/self/root/var/lib/fracgpu/ (the node's /var/lib/fracgpu)",
                    STATE,
                    "/var/lib/fracgpu",
                )
            ],
            id="through-self-root",
        ),
        pytest.param(
            host("/proc/42/task/42/cwd/var/lib/fracgpu"),
            [
                holds(
                    "/proc/42/task/42/cwd/var/lib/fracgpu (the node's /var/lib/fracgpu)",
                    STATE,
                    "/var/lib/fracgpu",
                )
            ],
            id="through-a-thread-cwd",
        ),
        # Text cannot resolve ".." after a /proc link; it stays under /proc, which is refused.
        pytest.param(
            host("/proc/1/root/../var/lib/fracgpu"),
            [
                PROCESSES.format(
                    "/proc/1/root/../var/lib/fracgpu (the node's /proc/1/var/lib/fracgpu)"
                )
            ],
            id="dot-dot-after-a-proc-link",
        ),
        pytest.param(
            host("//var//lib/./fracgpu"),
            [
                holds(
                    "//var//lib/./fracgpu (the node's /var/lib/fracgpu)", STATE, "/var/lib/fracgpu"
                )
            ],
            id="slashes-and-dots",
        ),
        pytest.param(
            host("/var/lib/kubelet/../fracgpu"),
            [
                holds(
                    "/var/lib/kubelet/../fracgpu (the node's /var/lib/fracgpu)",
                    STATE,
                    "/var/lib/fracgpu",
                )
            ],
            id="dot-dot",
        ),
        pytest.param(
            host("/var/lib/kubelet/device-plugins"),
            [holds("/var/lib/kubelet/device-plugins", PLUGINS, "/var/lib/kubelet/device-plugins")],
            id="device-plugin-sockets",
        ),
        pytest.param(
            host("/var/lib/kubelet/device-plugins/kubelet.sock"),
            [
                holds(
                    "/var/lib/kubelet/device-plugins/kubelet.sock",
                    PLUGINS,
                    "/var/lib/kubelet/device-plugins",
                )
            ],
            id="kubelet-socket",
        ),
        pytest.param(
            host("/var/lib/kubelet/pod-resources"),
            [
                holds(
                    "/var/lib/kubelet/pod-resources",
                    "kubelet's pod resources socket",
                    "/var/lib/kubelet/pod-resources",
                )
            ],
            id="pod-resources",
        ),
        pytest.param(
            host("/var/lib/kubelet/plugins_registry"),
            [
                holds(
                    "/var/lib/kubelet/plugins_registry",
                    "kubelet's plugin registration sockets",
                    "/var/lib/kubelet/plugins_registry",
                )
            ],
            id="plugins-registry",
        ),
        pytest.param(
            host("/var/run/cdi"),
            [holds("/var/run/cdi", "container device specifications", "/var/run/cdi")],
            id="cdi-specs",
        ),
        pytest.param(
            host("/etc/cdi/nvidia.yaml"),
            [holds("/etc/cdi/nvidia.yaml", "container device specifications", "/etc/cdi")],
            id="static-cdi-spec",
        ),
        pytest.param(
            host("/var/lib/kubelet"),
            [contains("/var/lib/kubelet", PLUGINS, "/var/lib/kubelet/device-plugins")],
            id="parent-of-kubelet-sockets",
        ),
        pytest.param(
            host("/var/lib"),
            [contains("/var/lib", STATE, "/var/lib/fracgpu")],
            id="parent-of-state",
        ),
        pytest.param(host("/"), [contains("/", STATE, "/var/lib/fracgpu")], id="root"),
        pytest.param(
            host("/proc/1/root"),
            [contains("/proc/1/root (the node's /)", STATE, "/var/lib/fracgpu")],
            id="root-through-proc",
        ),
        pytest.param(host("/proc"), [PROCESSES.format("/proc")], id="proc"),
        pytest.param(host("/proc/1"), [PROCESSES.format("/proc/1")], id="a-process"),
        pytest.param(
            host("/proc/1/root/proc/1"),
            [PROCESSES.format("/proc/1/root/proc/1 (the node's /proc/1)")],
            id="proc-through-proc",
        ),
        pytest.param(host("/var/lib/fracgpu-old"), [], id="look-alike"),
        pytest.param(host("/var/lib/kubelet/pods"), [], id="kubelet-pods"),
        pytest.param(host("/proc/1/root/data"), [], id="elsewhere-through-proc"),
        pytest.param(host("/data"), [], id="elsewhere"),
        pytest.param(host("/var/lib/fracgpu", grant=None), [], id="no-gpu-pod"),
        pytest.param(host(7), [], id="not-a-path"),
    ],
)
def test_no_reserved_host_paths(pod: PodView, expected: list[str]) -> None:
    assert problems(no_reserved_host_paths, pod) == expected


@pytest.mark.parametrize(
    ("pod", "denied"),
    [
        pytest.param(
            mounted("/var/run/nvidia-container-devices/all"),
            ["/var/run/nvidia-container-devices/all"],
            id="all-cards",
        ),
        pytest.param(
            mounted("/var/run/nvidia-container-devices/GPU-1", grant=None),
            ["/var/run/nvidia-container-devices/GPU-1"],
            id="no-gpu-pod",
        ),
        pytest.param(
            mounted("/run/nvidia-container-devices/0"),
            ["/run/nvidia-container-devices/0"],
            id="through-run",
        ),
        pytest.param(
            mounted("//var/run/./nvidia-container-devices"),
            ["//var/run/./nvidia-container-devices"],
            id="the-directory-spelled-oddly",
        ),
        pytest.param(mounted("/var/run/nvidia-container-devices-x", "/var/run"), [], id="others"),
    ],
)
def test_no_device_list_mounts(pod: PodView, denied: list[str]) -> None:
    assert problems(no_device_list_mounts, pod) == [
        f'container "c": volume mount at {path} selects GPUs (/var/run/nvidia-container-devices '
        f"is where the fracgpu device plugin names a container's cards); remove it and request "
        f"fracgpu.io/gpu instead"
        for path in denied
    ]


@pytest.mark.parametrize(
    ("annotations", "grant", "denied"),
    [
        pytest.param(
            {"cdi.k8s.io/gpu": "nvidia.com/gpu=all"}, None, ["cdi.k8s.io/gpu"], id="no-gpu-pod"
        ),
        pytest.param({"cdi.k8s.io/x": "vendor/c=d"}, SHARE, ["cdi.k8s.io/x"], id="gpu-pod"),
        pytest.param({"example.com/cdi.k8s.io": "x"}, None, [], id="look-alike"),
    ],
)
def test_no_cdi_annotations(
    annotations: dict[str, str], grant: Grant | None, denied: list[str]
) -> None:
    pod = view(container(grant=grant), annotations=annotations)
    assert problems(no_cdi_annotations, pod) == [
        f"annotation {key} asks the container runtime for devices (cdi.k8s.io/ annotations "
        f"inject them by name) and cannot be set on a pod; remove it and request fracgpu.io/gpu "
        f"instead"
        for key in denied
    ]


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
