"""The committed generated code is fresh, and the protos say what kubelet expects on the wire."""

from __future__ import annotations

from pathlib import Path

from google.protobuf.descriptor import FieldDescriptor

from deviceplugin._proto import deviceplugin_v1beta1_pb2 as pb
from deviceplugin._proto import podresources_v1_pb2 as pr
from deviceplugin.shared import protogen


def test_committed_generated_code_is_fresh(tmp_path: Path) -> None:
    written = protogen.generate(tmp_path)
    names = sorted(p.name for p in written)
    committed = sorted(p.name for p in protogen.OUTPUT_DIR.iterdir() if p.suffix == ".py")
    assert names == committed
    for path in written:
        assert path.read_text() == (protogen.OUTPUT_DIR / path.name).read_text(), (
            f"{path.name} is stale: run `python -m deviceplugin.shared.protogen`"
        )


def test_method_paths_match_kubelet() -> None:
    plugin = pb.DESCRIPTOR.services_by_name["DevicePlugin"]
    assert pb.DESCRIPTOR.package == "v1beta1"
    assert [m.name for m in plugin.methods] == [
        "GetDevicePluginOptions",
        "ListAndWatch",
        "GetPreferredAllocation",
        "Allocate",
        "PreStartContainer",
    ]
    assert plugin.methods_by_name["ListAndWatch"].server_streaming
    assert pb.DESCRIPTOR.services_by_name["Registration"].full_name == "v1beta1.Registration"
    assert pr.DESCRIPTOR.package == "v1"
    lister = pr.DESCRIPTOR.services_by_name["PodResourcesLister"]
    assert {m.name for m in lister.methods} == {"List", "GetAllocatableResources", "Get"}


def _fields(message: object) -> dict[str, tuple[int, int, bool]]:
    descriptor = message.DESCRIPTOR  # type: ignore[attr-defined]
    return {f.name: (f.number, f.type, f.is_repeated) for f in descriptor.fields}


def test_field_numbers_and_types_match_the_reference() -> None:
    string, boolean, message, int32, int64 = (
        FieldDescriptor.TYPE_STRING,
        FieldDescriptor.TYPE_BOOL,
        FieldDescriptor.TYPE_MESSAGE,
        FieldDescriptor.TYPE_INT32,
        FieldDescriptor.TYPE_INT64,
    )
    assert _fields(pb.RegisterRequest) == {
        "version": (1, string, False),
        "endpoint": (2, string, False),
        "resource_name": (3, string, False),
        "options": (4, message, False),
    }
    assert _fields(pb.DevicePluginOptions) == {
        "pre_start_required": (1, boolean, False),
        "get_preferred_allocation_available": (2, boolean, False),
    }
    assert _fields(pb.Device) == {
        "ID": (1, string, False),
        "health": (2, string, False),
        "topology": (3, message, False),
    }
    assert _fields(pb.NUMANode) == {"ID": (1, int64, False)}
    assert _fields(pb.ContainerAllocateRequest) == {"devices_ids": (1, string, True)}
    assert _fields(pb.PreStartContainerRequest) == {"devices_ids": (1, string, True)}
    assert _fields(pb.ContainerPreferredAllocationRequest) == {
        "available_deviceIDs": (1, string, True),
        "must_include_deviceIDs": (2, string, True),
        "allocation_size": (3, int32, False),
    }
    assert _fields(pb.ContainerPreferredAllocationResponse) == {"deviceIDs": (1, string, True)}
    response = _fields(pb.ContainerAllocateResponse)
    assert {k: v[0] for k, v in response.items()} == {
        "envs": 1,
        "mounts": 2,
        "devices": 3,
        "annotations": 4,
        "cdi_devices": 5,
    }
    assert _fields(pb.Mount) == {
        "container_path": (1, string, False),
        "host_path": (2, string, False),
        "read_only": (3, boolean, False),
    }
    assert _fields(pb.DeviceSpec) == {
        "container_path": (1, string, False),
        "host_path": (2, string, False),
        "permissions": (3, string, False),
    }
    assert _fields(pr.ContainerDevices) == {
        "resource_name": (1, string, False),
        "device_ids": (2, string, True),
        "topology": (3, message, False),
    }
    assert {k: v[0] for k, v in _fields(pr.ContainerResources).items()} == {
        "name": 1,
        "devices": 2,
        "cpu_ids": 3,
        "memory": 4,
        "dynamic_resources": 5,
    }
    assert {k: v[0] for k, v in _fields(pr.PodResources).items()} == {
        "name": 1,
        "namespace": 2,
        "containers": 3,
    }
