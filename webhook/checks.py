"""What a pod may not set, because the device plugin, the hook or the node trust it.

One small check per rule, each a function of one :class:`PodView` (the pod walked once) and the
admission configuration, returning the denial messages; :data:`CHECKS` is the registry the
mutator runs. Adding a rule is adding a function and a line, and a named-case table in
``tests/test_webhook_checks.py``.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from core.contract import (
    DEVICE_LIST_MOUNT_ROOT,
    HOST_ROOT,
    LD_SO_PRELOAD,
    RESERVED_CONTAINER_PATHS,
    VISIBLE_DEVICES_ENV,
)
from core.labels import MODEL_ANNOTATION, MODEL_EXCLUDE_ANNOTATION
from core.placement import PLACEMENT_ANNOTATION
from core.policy import POLICY_ANNOTATION, PRIORITY_ANNOTATION
from core.units import DOMAIN, REQUEST_ANNOTATION, SYSTEM_ENV_PREFIX
from webhook.config import AdmissionConfig
from webhook.resources import ContainerResult
from webhook.wording import container_ref, quote

# The NVIDIA container runtime hands cards to any container that sets this variable; only the
# device plugin may set it. These values expose no card.
HARMLESS_VISIBLE_DEVICES = frozenset({"", "void", "none"})


# Not frozen, and filled once: one of each is built per container on every admission, which
# a frozen dataclass makes slower, and every check reads the same few fields.
@dataclass(slots=True)
class Container:
    """One container of the pod, with what its request normalised to."""

    spec: Mapping[str, Any]
    result: ContainerResult
    granted_env: Mapping[str, str]  # the FRACGPU_* variables its grant puts in it
    env: tuple[Mapping[str, Any], ...]
    mount_paths: tuple[str, ...]

    @classmethod
    def of(
        cls, spec: Mapping[str, Any], result: ContainerResult, granted_env: Mapping[str, str]
    ) -> Container:
        env = spec.get("env")
        mounts = spec.get("volumeMounts")
        return cls(
            spec,
            result,
            granted_env,
            tuple(v for v in env if isinstance(v, dict)) if isinstance(env, list) else (),
            tuple(
                m["mountPath"]
                for m in mounts
                if isinstance(m, dict) and isinstance(m.get("mountPath"), str)
            )
            if isinstance(mounts, list)
            else (),
        )

    @property
    def ref(self) -> str:
        return container_ref(self.result.name)


@dataclass(slots=True)
class PodView:
    """A pod (or pod template) as every check sees it: walked once, shared by all."""

    containers: tuple[Container, ...]
    gpu: bool  # some container holds a grant
    annotations: Mapping[str, Any]
    host_paths: tuple[tuple[str, str], ...]  # (volume name as messages quote it, hostPath)

    @classmethod
    def of(
        cls,
        spec: Mapping[str, Any],
        meta: Mapping[str, Any],
        containers: tuple[Container, ...],
        gpu: bool,
    ) -> PodView:
        annotations = meta.get("annotations")
        volumes = spec.get("volumes")
        host_paths = []
        for volume in volumes if isinstance(volumes, list) else ():
            host = volume.get("hostPath") if isinstance(volume, dict) else None
            path = host.get("path") if isinstance(host, dict) else None
            if isinstance(path, str):
                host_paths.append((quote(volume.get("name")), path))
        return cls(
            containers,
            gpu,
            annotations if isinstance(annotations, dict) else {},
            tuple(host_paths),
        )

    def mounts_under(self, roots: tuple[str, ...]) -> list[tuple[Container, str]]:
        """(container, mountPath as written) of every volume mount at or under one of roots."""
        return [
            (c, path)
            for c in self.containers
            for path in c.mount_paths
            if _under(_normal(path), roots)
        ]


Check = Callable[[PodView, AdmissionConfig], Iterable[str]]


_RESERVED_ENV = (VISIBLE_DEVICES_ENV, SYSTEM_ENV_PREFIX)


def no_system_env(pod: PodView, config: AdmissionConfig) -> Iterator[str]:
    """``NVIDIA_VISIBLE_DEVICES`` selects cards; ``FRACGPU_*`` describe the grant. Only fracgpu
    sets them: a literal equal to what the container's grant implies is fracgpu's own (a pod
    made from an admitted template carries it), anything else is the user's."""
    for c in pod.containers:
        for var in c.env:
            name = var.get("name")
            # One C call rules out nearly every variable: a pod may carry thousands.
            if not (isinstance(name, str) and name.startswith(_RESERVED_ENV)):
                continue
            value, literal = var.get("value"), "valueFrom" not in var
            if name == VISIBLE_DEVICES_ENV:
                if not (literal and (value or "") in HARMLESS_VISIBLE_DEVICES):
                    yield (
                        f"{c.ref}: environment variable {VISIBLE_DEVICES_ENV} selects GPUs "
                        f"and is set only by the fracgpu device plugin; remove it and request "
                        f"fracgpu.io/gpu instead"
                    )
            elif name.startswith(SYSTEM_ENV_PREFIX) and not (
                literal and c.granted_env.get(name) == value
            ):
                yield (
                    f"{c.ref}: environment variable {name} is set by fracgpu "
                    f"and cannot be set in the pod spec (got {quote(value)}); remove it"
                )


def no_privileged_gpu_container(pod: PodView, config: AdmissionConfig) -> Iterator[str]:
    """A privileged container sees every card of the node, whatever its share."""
    if not pod.gpu or config.allow_privileged:
        return
    for c in pod.containers:
        security = c.spec.get("securityContext")
        if isinstance(security, dict) and security.get("privileged") is True:
            yield (
                f"{c.ref}: is privileged; a privileged container sees every GPU of the node and "
                f"escapes its share; remove securityContext.privileged from GPU pods"
            )


def no_reserved_mounts(pod: PodView, config: AdmissionConfig) -> Iterator[str]:
    """The device plugin mounts the hook, the preload file and the limits at these paths."""
    if not pod.gpu:
        return
    for c, path in pod.mounts_under(RESERVED_CONTAINER_PATHS):
        yield (
            f"{c.ref}: volume mount at {path} covers a path the fracgpu "
            f"device plugin mounts ({', '.join(RESERVED_CONTAINER_PATHS)}); mount the "
            f"volume elsewhere"
        )


# What a GPU pod may not reach on the node through a hostPath volume, and why: fracgpu's state
# (every container's limits and accounting), the preload list, kubelet's sockets (a client of
# the device plugin socket can starve kubelet's own calls; the others list or register every
# device) and the container device specifications a runtime would inject. A hostPath at, under
# or above one of them (``/`` included) is refused.
HOST_GUARDS: tuple[tuple[str, str], ...] = (
    (HOST_ROOT, "fracgpu's node state"),
    (LD_SO_PRELOAD, "the node's preload list"),
    ("/var/lib/kubelet/device-plugins", "kubelet's device plugin sockets"),
    ("/var/lib/kubelet/pod-resources", "kubelet's pod resources socket"),
    ("/var/lib/kubelet/plugins_registry", "kubelet's plugin registration sockets"),
    ("/var/run/cdi", "container device specifications"),
    ("/run/cdi", "container device specifications"),
    ("/etc/cdi", "container device specifications"),
)
# /proc/<pid>/root (and cwd, and per thread) is another process's view of the node's tree.
_PROC_ROOT = re.compile(r"^/proc/[^/]+(?:/task/[^/]+)?/(?:root|cwd)(?=/|$)")


def node_path(path: str) -> str:
    """The node path a hostPath reaches, as far as text can tell: ``..``, ``.``, repeated and
    trailing slashes resolved, and ``/proc/<pid>/root`` prefixes removed."""
    norm = _normal(path)
    while (match := _PROC_ROOT.match(norm)) is not None:
        norm = _normal(norm[match.end() :])
    return norm


def no_reserved_host_paths(pod: PodView, config: AdmissionConfig) -> Iterator[str]:
    """A hostPath may not reach what the node trusts (HOST_GUARDS), nor the process tree."""
    if not pod.gpu:
        return
    for name, path in pod.host_paths:
        norm = node_path(path)
        seen = path if norm == path else f"{path} (the node's {norm})"
        if _under(norm, ("/proc",)):
            yield (
                f"volume {name}: hostPath {seen} exposes the node's processes, and through "
                f"them every path of the node, and cannot be mounted into a GPU pod; remove it"
            )
            continue
        for guard, what in HOST_GUARDS:
            if _under(norm, (guard,)):
                yield (
                    f"volume {name}: hostPath {seen} holds {what} ({guard}) and cannot be "
                    f"mounted into a GPU pod; remove it"
                )
                break
            if _under(guard, (norm,)) or norm == "/":
                yield (
                    f"volume {name}: hostPath {seen} contains {what} ({guard}) and cannot be "
                    f"mounted into a GPU pod; mount a narrower path"
                )
                break


# With the NVIDIA container toolkit configured as docs/install.md says, a container gets the
# cards named by the mounts under this directory, and no longer NVIDIA_VISIBLE_DEVICES.
DEVICE_LIST_ROOTS = (DEVICE_LIST_MOUNT_ROOT, "/run/nvidia-container-devices")


def no_device_list_mounts(pod: PodView, config: AdmissionConfig) -> Iterator[str]:
    """Only the device plugin names cards by mounts there; on any pod, GPU or not."""
    for c, path in pod.mounts_under(DEVICE_LIST_ROOTS):
        yield (
            f"{c.ref}: volume mount at {path} selects GPUs ({DEVICE_LIST_MOUNT_ROOT} is "
            f"where the fracgpu device plugin names a container's cards); remove it "
            f"and request fracgpu.io/gpu instead"
        )


CDI_ANNOTATION_PREFIX = "cdi.k8s.io/"


def no_cdi_annotations(pod: PodView, config: AdmissionConfig) -> Iterator[str]:
    """A container runtime with CDI injects the devices these name; on any pod, GPU or not."""
    for key in pod.annotations:
        if key.startswith(CDI_ANNOTATION_PREFIX):
            yield (
                f"annotation {key} asks the container runtime for devices ({CDI_ANNOTATION_PREFIX}"
                f" annotations inject them by name) and cannot be set on a pod; remove it and "
                f"request fracgpu.io/gpu instead"
            )


# The record of the request and the policy read from it (fracgpu's own output, which a pod made
# from a mutated template carries), the pod's choice of GPU model and its priority.
USER_ANNOTATIONS = frozenset(
    {
        REQUEST_ANNOTATION,
        MODEL_ANNOTATION,
        MODEL_EXCLUDE_ANNOTATION,
        POLICY_ANNOTATION,
        PRIORITY_ANNOTATION,
    }
)


def no_reserved_annotations(pod: PodView, config: AdmissionConfig) -> Iterator[str]:
    """Annotations under fracgpu.io/ are fracgpu's, except those in USER_ANNOTATIONS.

    The placement record gets its own words, in every mode: with ``--placement extender`` the
    device plugin puts a container on the cards it names, so a forged one would take a card
    the extender booked for another pod; only the extender's Binding may write it. (In the
    mode ``node`` the plugin never reads it, but a pod carrying one would be misread the day
    the cluster switches.)"""
    if not pod.gpu:
        return
    for key in pod.annotations:
        if key == PLACEMENT_ANNOTATION:
            yield (
                f"annotation {key} is the card fracgpu's scheduler extender records when it "
                f"binds a GPU pod, written only with the pod's binding; a pod cannot set it "
                f"(the device plugin would place the pod on the cards it names); remove it"
            )
        elif key.startswith(f"{DOMAIN}/") and key not in USER_ANNOTATIONS:
            yield (
                f"annotation {key} is reserved for fracgpu and cannot be set on a GPU pod; "
                f"remove it"
            )


CHECKS: tuple[Check, ...] = (
    no_system_env,
    no_privileged_gpu_container,
    no_reserved_mounts,
    no_reserved_host_paths,
    no_device_list_mounts,
    no_reserved_annotations,
    no_cdi_annotations,
)


def forbidden(pod: PodView, config: AdmissionConfig) -> list[str]:
    """Every problem every check finds, in registry order."""
    return [problem for check in CHECKS for problem in check(pod, config)]


def _normal(path: str) -> str:
    return posixpath.normpath("/" + path.strip().lstrip("/"))


def _under(path: str, roots: Iterable[str]) -> bool:
    return any(path == root or path.startswith(root + "/") for root in roots)
