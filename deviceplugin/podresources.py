"""Client of kubelet's PodResources API: who holds which fracgpu device IDs."""

from __future__ import annotations

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

    def ids(self, resource: str) -> frozenset[str]:
        return self.devices.get(resource, frozenset())

    @property
    def name(self) -> str:
        return f"{self.namespace}/{self.pod}/{self.container}"


def merge(response: pr.ListPodResourcesResponse, resources: set[str]) -> list[ContainerDevices]:
    """Containers that hold any of ``resources``, their entries merged by resource name."""
    containers = []
    for pod in response.pod_resources:
        for container in pod.containers:
            merged: dict[str, set[str]] = defaultdict(set)
            for entry in container.devices:
                if entry.resource_name in resources:
                    merged[entry.resource_name].update(entry.device_ids)
            if merged:
                containers.append(
                    ContainerDevices(
                        pod.namespace,
                        pod.name,
                        container.name,
                        {r: frozenset(ids) for r, ids in merged.items()},
                    )
                )
    return containers


class PodResourcesClient:
    def __init__(self, socket: Path, timeout_s: float) -> None:
        self.socket = socket
        self.timeout_s = timeout_s
        self._channel: grpc.Channel | None = None

    def _stub(self) -> pr_grpc.PodResourcesListerStub:
        if self._channel is None:
            self._channel = grpc.insecure_channel(f"unix://{self.socket}")
        return pr_grpc.PodResourcesListerStub(self._channel)

    def list(self, resources: set[str]) -> list[ContainerDevices]:
        try:
            response = self._stub().List(pr.ListPodResourcesRequest(), timeout=self.timeout_s)
        except grpc.RpcError as exc:
            self.close()  # a restarted kubelet listens on a new socket inode: dial afresh
            raise PodResourcesError(
                f"kubelet PodResources List on {self.socket} failed: "
                f"{exc.code().name}: {exc.details()}"
            ) from None
        return merge(response, resources)

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
