"""FakeKubelet: a strict test double of kubelet's device manager and PodResources server.

Real gRPC on unix sockets in a temporary directory, behaving as kubelet's device manager
(``pkg/kubelet/cm/devicemanager``) and PodResources server do and as a real kubelet v1.36 was seen
to behave, and refusing what a real kubelet refuses:

- Registration server on ``<dir>/kubelet.sock``: Register rejects a version other than v1beta1,
  a resource name that is not an extended resource name, and an endpoint that is not a file name;
  then, inside the Register RPC, it dials the plugin's socket (10 s, like kubelet) and calls
  GetDevicePluginOptions, so a plugin that registers before it serves fails to register.
- One ListAndWatch consumer per registered resource; every message replaces the device list
  (IDs must be unique and at most 63 characters, health exactly "Healthy"/"Unhealthy"). When the
  stream ends, the resource's devices all count as unhealthy (allocatable 0).
- ``admit(pod)``: for each init container, then each app container, for each of its resources in
  a *random order* (map order): GetPreferredAllocation (when the plugin asked for it) with the
  healthy free IDs, then Allocate with the preferred set in random order. As kubelet's device
  manager does (``devicesToAllocate``), IDs come only from Healthy, unallocated devices, and when
  the preference is empty the IDs are drawn at random (Go map order) from those, across cards.
  An app container first reuses the IDs of the pod's init containers (kubelet's
  ``devicesToReuse``) and takes the rest afresh; Allocate is called for it all the same. A
  preference that is not a subset of the available IDs or has the wrong size is a protocol
  violation (kubelet would take what is usable and fill up). An Allocate error rejects the pod
  and releases its devices.
- ``schedulable(pod)``: what kube-scheduler computes for the node: for each resource the pod's
  request (the larger of its app containers' sum and its largest init container) fits
  allocatable (Healthy devices) minus what admitted pods hold.
- ``start(pod, container)``: PreStartContainer once per resource (random order), 30 s timeout;
  the allocation is recorded (and listed by PodResources) before it. Container restarts call it
  again with the same IDs.
- ``remove(pod)``: the pod was deleted or has terminated. kubelet lists only active pods in
  PodResources ``List`` and frees a gone pod's IDs for new allocations (``UpdateAllocatedDevices``
  before each admission); this double does both at once. It never tells the plugin.
- PodResources ``List``: one ContainerDevices entry per device ID, as a real kubelet sends them,
  for app containers only (kubelet lists no plain init container: their IDs appear under the app
  container that reuses them),
  in an order shuffled once per pod and holding. Each pod is serialised once and joined into
  every answer as bytes: kubelet answers List in Go, beside its device manager, and a double
  that spent milliseconds of this process's interpreter per call would put its own cost into
  the RPC timings of the test (or benchmark) driving it.
- ``restart()``: closes the streams, stops serving, deletes every socket in the directory except
  ``kubelet_internal_checkpoint``, and serves a new ``kubelet.sock``; allocations survive.

Fault injection: ``fail_podresources(n)`` makes the next n List calls fail with UNAVAILABLE;
``empty_listings(n)`` makes the next n List calls answer with no pods at all, as a kubelet does
right after it restarts, before it has read its pods back.
"""

from __future__ import annotations

import random
import re
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from deviceplugin._proto import deviceplugin_v1beta1_pb2 as pb
from deviceplugin._proto import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from deviceplugin._proto import podresources_v1_pb2 as pr

CHECKPOINT = "kubelet_internal_checkpoint"
Holding = tuple[tuple[str, tuple[str, ...]], ...]  # one container's (resource, device IDs)
_EXTENDED = re.compile(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")


class ProtocolViolation(AssertionError):
    """The plugin did something a real kubelet would reject or that breaks the API contract."""


class AdmissionError(RuntimeError):
    """The pod was rejected at admission (UnexpectedAdmissionError or insufficient devices)."""


class PreStartFailed(RuntimeError):
    """PreStartContainer failed; the container waits (CreateContainerConfigError) and retries."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


@dataclass
class Container:
    name: str
    requests: dict[str, int]


@dataclass
class Pod:
    namespace: str
    name: str
    containers: list[Container]
    init_containers: list[Container] = field(default_factory=list)

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass
class _Resource:
    name: str
    endpoint: str
    options: pb.DevicePluginOptions
    channel: grpc.Channel
    stub: pb_grpc.DevicePluginStub
    devices: dict[str, str] = field(default_factory=dict)
    connected: bool = True
    messages: int = 0
    stream: object | None = None


class FakeKubelet:
    def __init__(self, plugin_dir: Path, podresources_socket: Path, *, seed: int = 0) -> None:
        self.plugin_dir = plugin_dir
        self.podresources_socket = podresources_socket
        self.random = random.Random(seed)
        self._lock = threading.Condition()
        self.resources: dict[str, _Resource] = {}
        # pod key -> container name -> resource -> device IDs (kubelet's checkpoint)
        self.allocations: dict[str, dict[str, dict[str, list[str]]]] = {}
        # pod key -> container name -> resource -> the plugin's Allocate answer
        self.responses: dict[str, dict[str, dict[str, pb.ContainerAllocateResponse]]] = {}
        self.register_calls: list[pb.RegisterRequest] = []
        self.calls: list[tuple[str, str]] = []  # (resource, rpc) in order
        self.violations: list[str] = []
        # (monotonic time, resource, healthy count) for every ListAndWatch message received
        self.history: list[tuple[float, str, int]] = []
        self._server: grpc.Server | None = None
        self._pr_server: grpc.Server | None = None
        self._pr_failures = 0
        self._pr_empty = 0
        self.init_names: dict[str, set[str]] = {}  # pod key -> its init containers (not listed)
        self.list_calls = 0
        # (pod key, what its containers hold) -> that pod as a serialised one-pod List answer
        self._listed: dict[tuple[str, tuple[tuple[str, Holding], ...]], bytes] = {}

    # ---- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        self.plugin_dir.mkdir(parents=True, exist_ok=True)
        for entry in self.plugin_dir.iterdir():
            if entry.name != CHECKPOINT and not entry.is_dir():
                entry.unlink()  # CleanupPluginDirectory
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        pb_grpc.add_RegistrationServicer_to_server(_Registration(self), server)
        server.add_insecure_port(f"unix://{self.plugin_dir / 'kubelet.sock'}")
        server.start()
        self._server = server
        if self._pr_server is None:
            self.podresources_socket.parent.mkdir(parents=True, exist_ok=True)
            pr_server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
            pr_server.add_generic_rpc_handlers((self._podresources_handler(),))
            pr_server.add_insecure_port(f"unix://{self.podresources_socket}")
            pr_server.start()
            self._pr_server = pr_server

    def stop(self, *, podresources: bool = True) -> None:
        with self._lock:
            resources = list(self.resources.values())
            self.resources.clear()
        for resource in resources:
            resource.channel.close()
        if self._server is not None:
            self._server.stop(grace=0).wait(2)
            self._server = None
        if podresources and self._pr_server is not None:
            self._pr_server.stop(grace=0).wait(2)
            self._pr_server = None

    def restart(self) -> None:
        """kubelet restart: streams close, sockets deleted, new kubelet.sock; pods survive."""
        self.stop(podresources=False)
        self.start()

    # ---- registration and ListAndWatch -------------------------------------------------

    def _register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.Empty:
        self.register_calls.append(request)
        if request.version != "v1beta1":
            context.abort(grpc.StatusCode.UNKNOWN, f"unsupported version {request.version!r}")
        name = request.resource_name
        if not _EXTENDED.fullmatch(name) or name.split("/")[0].endswith("kubernetes.io"):
            context.abort(grpc.StatusCode.UNKNOWN, f"invalid extended resource name {name!r}")
        if not request.endpoint or "/" in request.endpoint:
            context.abort(grpc.StatusCode.UNKNOWN, f"endpoint {request.endpoint!r} is no file name")
        channel = grpc.insecure_channel(f"unix://{self.plugin_dir / request.endpoint}")
        try:
            grpc.channel_ready_future(channel).result(timeout=10)
            stub = pb_grpc.DevicePluginStub(channel)
            options = stub.GetDevicePluginOptions(pb.Empty(), timeout=10)
        except (grpc.FutureTimeoutError, grpc.RpcError) as exc:
            channel.close()
            context.abort(grpc.StatusCode.UNKNOWN, f"failed to dial device plugin: {exc!r}")
        resource = _Resource(name, request.endpoint, options, channel, stub)
        with self._lock:
            old = self.resources.get(name)
            self.resources[name] = resource
        if old is not None:
            old.channel.close()
        threading.Thread(target=self._consume, args=(resource,), daemon=True).start()
        return pb.Empty()

    def _consume(self, resource: _Resource) -> None:
        try:
            stream = resource.stub.ListAndWatch(pb.Empty())
            resource.stream = stream
            for message in stream:
                self._accept_list(resource, message)
        except grpc.RpcError:
            pass
        with self._lock:
            resource.connected = False  # PluginDisconnected: allocatable drops to 0
            self._lock.notify_all()

    def _accept_list(self, resource: _Resource, message: pb.ListAndWatchResponse) -> None:
        # Two attribute reads per device, then whole-list checks: a full node sends thousands
        # of devices per message, and this runs in the benchmark's process beside its timings.
        ids = [device.ID for device in message.devices]
        healths = [device.health for device in message.devices]
        for bad_id in (i for i in ids if not 0 < len(i) <= 63):
            self._violation(f"{resource.name}: device ID {bad_id!r} is not 1–63 chars")
        devices = dict(zip(ids, healths, strict=True))
        if len(devices) != len(ids):
            twice = next(i for i in ids if ids.count(i) > 1)
            self._violation(f"{resource.name}: device ID {twice!r} listed twice")
        for health in set(healths) - {"Healthy", "Unhealthy"}:
            self._violation(f"{resource.name}: health {health!r}")
        with self._lock:
            resource.devices = devices
            resource.messages += 1
            healthy = healths.count("Healthy")
            self.history.append((time.monotonic(), resource.name, healthy))
            self._lock.notify_all()

    def _violation(self, text: str) -> None:
        self.violations.append(text)
        raise ProtocolViolation(text)

    # ---- observation -------------------------------------------------------------------

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout
        with self._lock:
            while not predicate():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._lock.wait(min(remaining, 0.05))
            return True

    def registered(self, *names: str) -> bool:
        return all(
            n in self.resources and self.resources[n].connected and self.resources[n].messages
            for n in names
        )

    def healthy(self, resource: str) -> set[str]:
        with self._lock:
            state = self.resources.get(resource)
            if state is None or not state.connected:
                return set()
            return {i for i, h in state.devices.items() if h == "Healthy"}

    def allocatable(self, resource: str) -> int:
        """What the Node reports: healthy devices (allocated ones included)."""
        return len(self.healthy(resource))

    def capacity(self, resource: str) -> int:
        with self._lock:
            state = self.resources.get(resource)
            return 0 if state is None else len(state.devices)

    def allocated_ids(self, resource: str) -> set[str]:
        return {
            i
            for containers in self.allocations.values()
            for held in containers.values()
            for i in held.get(resource, [])
        }

    def free(self, resource: str) -> set[str]:
        return self.healthy(resource) - self.allocated_ids(resource)

    # ---- pods --------------------------------------------------------------------------

    def admit(self, pod: Pod) -> dict[str, dict[str, list[str]]]:
        """Admit a pod as kubelet does; raise AdmissionError as kubelet would reject it."""
        if pod.key in self.allocations:
            raise ValueError(f"pod {pod.key} is already admitted")
        self.allocations[pod.key] = {}
        self.init_names[pod.key] = {c.name for c in pod.init_containers}
        reusable: dict[str, list[str]] = {}
        try:
            for container in [*pod.init_containers, *pod.containers]:
                held: dict[str, list[str]] = {}
                self.allocations[pod.key][container.name] = held
                names = list(container.requests)
                self.random.shuffle(names)  # map order: varies from run to run
                for name in names:
                    size = container.requests[name]
                    reuse = reusable.get(name, [])[:size]
                    held[name] = self._allocate(pod, container, name, size, reuse)
                    if container in pod.init_containers:
                        reusable[name] = held[name]
        except BaseException:
            del self.allocations[pod.key]
            self.init_names.pop(pod.key, None)
            raise
        return self.allocations[pod.key]

    def schedulable(self, pod: Pod) -> bool:
        """Whether kube-scheduler's resource check passes for this node."""
        for name in {r for c in [*pod.init_containers, *pod.containers] for r in c.requests}:
            apps = sum(c.requests.get(name, 0) for c in pod.containers)
            inits = max((c.requests.get(name, 0) for c in pod.init_containers), default=0)
            if max(apps, inits) > self.allocatable(name) - len(self.allocated_ids(name)):
                return False
        return True

    def _allocate(
        self, pod: Pod, container: Container, name: str, size: int, reuse: list[str]
    ) -> list[str]:
        with self._lock:
            resource = self.resources.get(name)
        if resource is None or not resource.connected:
            raise AdmissionError(f"{name}: no healthy devices present; cannot allocate unhealthy")
        available = sorted(self.free(name) | set(reuse))
        if len(available) < size:
            raise AdmissionError(
                f"{pod.key}/{container.name}: requested {name}: {size}, available {len(available)}"
            )
        chosen: list[str] = list(reuse)
        if len(chosen) < size and resource.options.get_preferred_allocation_available:
            self.random.shuffle(available)
            self.calls.append((name, "GetPreferredAllocation"))
            answer = resource.stub.GetPreferredAllocation(
                pb.PreferredAllocationRequest(
                    container_requests=[
                        pb.ContainerPreferredAllocationRequest(
                            available_deviceIDs=available,
                            must_include_deviceIDs=reuse,
                            allocation_size=size,
                        )
                    ]
                ),
                timeout=10,
            )
            if len(answer.container_responses) != 1:
                self._violation(f"{name}: {len(answer.container_responses)} preference answers")
            preferred = list(answer.container_responses[0].deviceIDs)
            if preferred and (
                len(set(preferred)) != size
                or not set(preferred) <= set(available)
                or not set(reuse) <= set(preferred)
            ):
                self._violation(f"{name}: preference {preferred[:5]}… is not {size} available IDs")
            chosen = preferred or chosen
        if len(chosen) < size:
            rest = sorted(set(available) - set(chosen))
            chosen += self.random.sample(rest, size - len(chosen))
        self.random.shuffle(chosen)
        self.calls.append((name, "Allocate"))
        try:
            answer = resource.stub.Allocate(
                pb.AllocateRequest(
                    container_requests=[pb.ContainerAllocateRequest(devices_ids=chosen)]
                ),
                timeout=10,
            )
        except grpc.RpcError as exc:
            raise AdmissionError(
                f"Allocate failed due to rpc error: code = {exc.code().name} desc = "
                f"{exc.details()}, which is unexpected"
            ) from None
        if len(answer.container_responses) != 1:
            self._violation(f"{name}: {len(answer.container_responses)} Allocate answers")
        self.responses.setdefault(pod.key, {}).setdefault(container.name, {})[name] = (
            answer.container_responses[0]
        )
        return chosen

    def start_container(self, pod: Pod, container: str) -> None:
        """PreStartContainer for each resource the container holds (container (re)start)."""
        held = self.allocations[pod.key][container]
        names = list(held)
        self.random.shuffle(names)
        for name in names:
            with self._lock:
                resource = self.resources.get(name)
            if resource is None or not resource.options.pre_start_required:
                continue
            self.calls.append((name, "PreStartContainer"))
            try:
                resource.stub.PreStartContainer(
                    pb.PreStartContainerRequest(devices_ids=held[name]), timeout=30
                )
            except grpc.RpcError as exc:
                raise PreStartFailed(exc.code(), exc.details() or "") from None

    def remove(self, pod: Pod) -> None:
        """The pod was deleted (or terminated): gone from List, its IDs free for new pods."""
        self.allocations.pop(pod.key, None)
        self.responses.pop(pod.key, None)
        self.init_names.pop(pod.key, None)

    # ---- PodResources ------------------------------------------------------------------

    def fail_podresources(self, count: int) -> None:
        self._pr_failures = count

    def empty_listings(self, count: int) -> None:
        self._pr_empty = count

    def _podresources_handler(self) -> grpc.GenericRpcHandler:
        """PodResourcesLister with List only (Get and GetAllocatableResources: UNIMPLEMENTED).

        List answers with bytes it assembles itself (identity serialiser): kubelet answers from
        Go in well under a millisecond, and a double that built and re-serialised protobuf
        objects in Python would put its own cost, several times the plugin's, into every
        PreStartContainer the benchmark times.
        """

        def list_(request: pr.ListPodResourcesRequest, context: grpc.ServicerContext) -> bytes:
            return self._list(context)

        return grpc.method_handlers_generic_handler(
            "v1.PodResourcesLister",
            {
                "List": grpc.unary_unary_rpc_method_handler(
                    list_,
                    request_deserializer=pr.ListPodResourcesRequest.FromString,
                    response_serializer=bytes,
                )
            },
        )

    def _list(self, context: grpc.ServicerContext) -> bytes:
        """A serialised ListPodResourcesResponse of every pod holding devices.

        Serialised messages concatenate into one whose repeated fields hold all their entries,
        so each pod is encoded once, as a one-pod response, and an answer is their join.
        """
        self.list_calls += 1
        if self._pr_failures > 0:
            self._pr_failures -= 1
            context.abort(grpc.StatusCode.UNAVAILABLE, "kubelet busy (injected)")
        if self._pr_empty > 0:
            self._pr_empty -= 1
            return b""  # an empty ListPodResourcesResponse
        return b"".join(self._listed_pod(k, c) for k, c in list(self.allocations.items()))

    def _listed_pod(self, key: str, containers: dict[str, dict[str, list[str]]]) -> bytes:
        hidden = self.init_names.get(key, set())
        holding = tuple(
            (name, tuple((r, tuple(ids)) for r, ids in held.items()))
            for name, held in list(containers.items())
            if name not in hidden
        )
        listed = self._listed.get((key, holding))
        if listed is None:
            namespace, name = key.split("/", 1)
            pod = pr.PodResources(name=name, namespace=namespace)
            for container_name, held in holding:
                entries = [(r, i) for r, ids in held for i in ids]
                self.random.shuffle(entries)
                pod.containers.add(
                    name=container_name,
                    devices=[  # one entry per device ID, as observed
                        pr.ContainerDevices(resource_name=r, device_ids=[i]) for r, i in entries
                    ],
                )
            if len(self._listed) > 4096:
                self._listed.clear()
            listed = pr.ListPodResourcesResponse(pod_resources=[pod]).SerializeToString()
            self._listed[(key, holding)] = listed
        return listed


class _Registration(pb_grpc.RegistrationServicer):
    def __init__(self, kubelet: FakeKubelet) -> None:
        self.kubelet = kubelet

    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.Empty:
        return self.kubelet._register(request, context)
