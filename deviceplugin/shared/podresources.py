"""Client of kubelet's PodResources API: who holds which fracgpu device IDs, and (DRA mode)
which of the driver's claims."""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from deviceplugin._proto import podresources_v1_pb2 as pr
from deviceplugin._proto import podresources_v1_pb2_grpc as pr_grpc


class PodResourcesError(RuntimeError):
    """kubelet's PodResources API did not answer (transient: callers retry)."""


@dataclass(frozen=True, slots=True)
class ContainerDevices:
    namespace: str
    pod: str
    container: str
    # resource name -> device IDs, merged over kubelet's one-entry-per-ID listing
    devices: dict[str, frozenset[str]] = field(default_factory=dict)
    # (namespace, name) of the claims this container uses devices of the driver from (DRA)
    claims: frozenset[tuple[str, str]] = frozenset()

    def ids(self, resource: str) -> frozenset[str]:
        return self.devices.get(resource, frozenset())

    @property
    def name(self) -> str:
        return f"{self.namespace}/{self.pod}/{self.container}"


def merge(
    response: pr.ListPodResourcesResponse, resources: set[str], driver: str | None = None
) -> list[ContainerDevices]:
    """Containers that hold any of ``resources`` (their entries merged by resource name) or a
    device of ``driver`` through a claim."""
    containers = []
    for pod in response.pod_resources:
        for container in pod.containers:
            claims: frozenset[tuple[str, str]] = frozenset()
            if driver is not None and container.dynamic_resources:
                claims = frozenset(
                    (d.claim_namespace, d.claim_name)
                    for d in container.dynamic_resources
                    if any(r.driver_name == driver for r in d.claim_resources)
                )
            # Each protobuf attribute read is the cost on a full node (thousands of one-ID
            # entries): read every entry once into plain tuples, then let comprehensions
            # do the merging.
            entries = [(e.resource_name, e.device_ids) for e in container.devices]
            merged: dict[str, frozenset[str]] = {}
            for resource in resources:
                held = frozenset([i for name, ids in entries if name == resource for i in ids])
                if held:
                    merged[resource] = held
            if not merged and not claims:
                continue
            containers.append(
                ContainerDevices(pod.namespace, pod.name, container.name, merged, claims)
            )
    return containers


def find(
    response: pr.ListPodResourcesResponse,
    resource: str,
    wanted: frozenset[str],
    resources: set[str],
) -> ContainerDevices | None:
    """The container holding exactly ``wanted`` of ``resource``, or None.

    Device IDs are exclusive, so a container whose first ``resource`` entry names an ID outside
    ``wanted`` is skipped without merging the rest of its (one-per-ID) entries: on a full node
    this looks at one entry per container instead of thousands.
    """
    for pod in response.pod_resources:
        for container in pod.containers:
            first = next((e for e in container.devices if e.resource_name == resource), None)
            if first is None or not first.device_ids or first.device_ids[0] not in wanted:
                continue
            merged: dict[str, set[str]] = defaultdict(set)
            for entry in container.devices:
                if entry.resource_name in resources:
                    merged[entry.resource_name].update(entry.device_ids)
            if merged[resource] != wanted:
                return None
            return ContainerDevices(
                pod.namespace,
                pod.name,
                container.name,
                {r: frozenset(ids) for r, ids in merged.items() if ids},
            )
    return None


class PodResourcesClient:
    def __init__(self, socket: Path, timeout_s: float) -> None:
        self.socket = socket
        self.timeout_s = timeout_s
        # PreStartContainer handlers, the verifier and the reconciler share one channel
        self._lock = threading.Lock()
        self._connected: tuple[grpc.Channel, pr_grpc.PodResourcesListerStub] | None = None

    def _connection(self) -> tuple[grpc.Channel, pr_grpc.PodResourcesListerStub]:
        with self._lock:
            if self._connected is None:
                channel = grpc.insecure_channel(f"unix://{self.socket}")
                self._connected = (channel, pr_grpc.PodResourcesListerStub(channel))
            return self._connected

    def _forget(self, channel: grpc.Channel) -> None:
        """Close ``channel`` if it is still the current one: the next call dials afresh.

        Another thread may already have replaced it after its own failure; closing the new
        channel would cancel that thread's calls, and its failure would close the next one.
        """
        with self._lock:
            current = self._connected is not None and self._connected[0] is channel
            if current:
                self._connected = None
        if current:
            channel.close()

    def _list(self) -> pr.ListPodResourcesResponse:
        channel, lister = self._connection()
        try:
            return lister.List(pr.ListPodResourcesRequest(), timeout=self.timeout_s)
        except grpc.RpcError as exc:
            self._forget(channel)  # a restarted kubelet may listen on a new socket inode
            raise PodResourcesError(
                f"kubelet PodResources List on {self.socket} failed: "
                f"{exc.code().name}: {exc.details()}"
            ) from None
        except ValueError as exc:  # closed by another caller's failure or by close()
            raise PodResourcesError(
                f"kubelet PodResources List on {self.socket} failed: {exc}"
            ) from None

    def list(self, resources: set[str], driver: str | None = None) -> list[ContainerDevices]:
        """Every container holding any of ``resources`` or a claim of ``driver``."""
        return merge(self._list(), resources, driver)

    def find(
        self, resource: str, wanted: frozenset[str], resources: set[str]
    ) -> ContainerDevices | None:
        """The one container holding exactly ``wanted`` (PreStartContainer, verification)."""
        return find(self._list(), resource, wanted, resources)

    def close(self) -> None:
        with self._lock:
            connected, self._connected = self._connected, None
        if connected is not None:
            connected[0].close()
