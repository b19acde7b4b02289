"""The DRA protos say what kubelet 1.36 expects on the wire: packages, method paths, fields."""

from __future__ import annotations

from typing import Any

import pytest
from google.protobuf.descriptor import FieldDescriptor

from deviceplugin._proto import dra_v1_pb2 as dra
from deviceplugin._proto import drahealth_v1alpha1_pb2 as health
from deviceplugin._proto import pluginregistration_v1_pb2 as reg

STRING, BOOL, MESSAGE, INT64, ENUM = (
    FieldDescriptor.TYPE_STRING,
    FieldDescriptor.TYPE_BOOL,
    FieldDescriptor.TYPE_MESSAGE,
    FieldDescriptor.TYPE_INT64,
    FieldDescriptor.TYPE_ENUM,
)


def _paths(module: Any, service: str) -> list[str]:
    descriptor = module.DESCRIPTOR.services_by_name[service]
    return [f"/{descriptor.full_name}/{m.name}" for m in descriptor.methods]


@pytest.mark.parametrize(
    ("module", "service", "paths"),
    [
        pytest.param(
            reg,
            "Registration",
            [
                "/pluginregistration.Registration/GetInfo",
                "/pluginregistration.Registration/NotifyRegistrationStatus",
            ],
            id="registration",
        ),
        pytest.param(
            dra,
            "DRAPlugin",
            [
                "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources",
                "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodeUnprepareResources",
            ],
            id="dra-v1",
        ),
        pytest.param(
            health,
            "DRAResourceHealth",
            ["/v1alpha1.DRAResourceHealth/NodeWatchResources"],
            id="health",
        ),
    ],
)
def test_method_paths(module: Any, service: str, paths: list[str]) -> None:
    assert _paths(module, service) == paths


def test_the_health_call_streams() -> None:
    method = health.DESCRIPTOR.services_by_name["DRAResourceHealth"].methods_by_name[
        "NodeWatchResources"
    ]
    assert method.server_streaming


def _fields(message: Any) -> dict[str, tuple[int, int, bool]]:
    return {f.name: (f.number, f.type, f.is_repeated) for f in message.DESCRIPTOR.fields}


@pytest.mark.parametrize(
    ("message", "fields"),
    [
        pytest.param(
            reg.PluginInfo,
            {
                "type": (1, STRING, False),
                "name": (2, STRING, False),
                "endpoint": (3, STRING, False),
                "supported_versions": (4, STRING, True),
            },
            id="PluginInfo",
        ),
        pytest.param(
            reg.RegistrationStatus,
            {"plugin_registered": (1, BOOL, False), "error": (2, STRING, False)},
            id="RegistrationStatus",
        ),
        pytest.param(
            dra.Claim,
            {
                "namespace": (1, STRING, False),
                "uid": (2, STRING, False),
                "name": (3, STRING, False),
            },
            id="Claim",
        ),
        pytest.param(
            dra.Device,
            {
                "request_names": (1, STRING, True),
                "pool_name": (2, STRING, False),
                "device_name": (3, STRING, False),
                "cdi_device_ids": (4, STRING, True),
                "share_id": (5, STRING, False),
            },
            id="Device",
        ),
        pytest.param(
            dra.NodePrepareResourceResponse,
            {"devices": (1, MESSAGE, True), "error": (2, STRING, False)},
            id="PrepareAnswer",
        ),
        pytest.param(
            dra.NodeUnprepareResourceResponse, {"error": (1, STRING, False)}, id="UnprepareAnswer"
        ),
        pytest.param(
            health.DeviceHealth,
            {
                "device": (1, MESSAGE, False),
                "health": (2, ENUM, False),
                "last_updated_time": (3, INT64, False),
                "health_check_timeout_seconds": (4, INT64, False),
                "message": (5, STRING, False),
            },
            id="DeviceHealth",
        ),
        pytest.param(
            health.DeviceIdentifier,
            {"pool_name": (1, STRING, False), "device_name": (2, STRING, False)},
            id="DeviceIdentifier",
        ),
    ],
)
def test_fields(message: Any, fields: dict[str, tuple[int, int, bool]]) -> None:
    assert _fields(message) == fields


def test_share_id_is_optional() -> None:
    assert dra.Device.DESCRIPTOR.fields_by_name["share_id"].has_presence


def test_prepare_answers_are_keyed_by_claim_uid() -> None:
    field = dra.NodePrepareResourcesResponse.DESCRIPTOR.fields_by_name["claims"]
    assert field.message_type.GetOptions().map_entry


def test_health_values() -> None:
    assert (health.UNKNOWN, health.HEALTHY, health.UNHEALTHY) == (0, 1, 2)
