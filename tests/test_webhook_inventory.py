"""GPU inventory: models from node labels and configuration, and how pods pin a model."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from core.labels import ModelSet, pinned_products
from webhook.gpumodels import GpuModel
from webhook.inventory import Inventory

H100 = {"fracgpu.io/gpu.product": "NVIDIA-H100-80GB-HBM3", "fracgpu.io/gpu.memory-mib": "81559"}
L4_GFD = {"nvidia.com/gpu.product": "NVIDIA-L4", "nvidia.com/gpu.memory": "23034"}


def inventory() -> Inventory:
    inv = Inventory({"Static-GPU": 16384})
    inv.set_node("h1", H100)
    inv.set_node("l1", L4_GFD)
    inv.set_node("cpu", {"kubernetes.io/os": "linux"})
    return inv


def test_models_from_labels_and_config() -> None:
    assert inventory().models() == {
        "Static-GPU": GpuModel("Static-GPU", 16384),
        "NVIDIA-H100-80GB-HBM3": GpuModel("NVIDIA-H100-80GB-HBM3", 81559),
        "NVIDIA-L4": GpuModel("NVIDIA-L4", 23034),
    }


def test_node_removal_and_relabel() -> None:
    inv = inventory()
    inv.remove_node("l1")
    inv.set_node("h1", {})
    assert set(inv.models()) == {"Static-GPU"}


def test_unpinned_mixed_cluster_takes_smallest_and_warns() -> None:
    choice = inventory().choose({})
    assert choice.card == GpuModel("Static-GPU", 16384)
    assert choice.largest == GpuModel("NVIDIA-H100-80GB-HBM3", 81559)
    assert choice.card is not None
    assert "the smallest of 3 GPU models" in str(choice.warning(choice.card))


def test_unpinned_mixed_cluster_offers_every_model_smallest_first() -> None:
    choice = inventory().choose({})
    assert [c.product for c in choice.cards] == [
        "Static-GPU",
        "NVIDIA-L4",
        "NVIDIA-H100-80GB-HBM3",
    ]


@pytest.mark.parametrize(
    ("spec", "product"),
    [
        (
            {"nodeSelector": {"fracgpu.io/gpu.product": "NVIDIA-H100-80GB-HBM3"}},
            "NVIDIA-H100-80GB-HBM3",
        ),
        ({"nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-L4"}}, "NVIDIA-L4"),
        ({"nodeName": "h1"}, "NVIDIA-H100-80GB-HBM3"),
        (
            {
                "affinity": {
                    "nodeAffinity": {
                        "requiredDuringSchedulingIgnoredDuringExecution": {
                            "nodeSelectorTerms": [
                                {
                                    "matchExpressions": [
                                        {
                                            "key": "nvidia.com/gpu.product",
                                            "operator": "In",
                                            "values": ["NVIDIA-L4"],
                                        }
                                    ]
                                }
                            ]
                        }
                    }
                }
            },
            "NVIDIA-L4",
        ),
    ],
    ids=["fracgpu label", "GPU feature discovery label", "node name", "required affinity"],
)
def test_pinned(spec: dict[str, Any], product: str) -> None:
    choice = inventory().choose(spec)
    assert [c.product for c in choice.cards] == [product]


@pytest.mark.parametrize(
    ("spec", "pin"),
    [
        pytest.param({}, "fracgpu.io/gpu.product", id="unpinned"),
        pytest.param(
            {"nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-L4"}},
            "nvidia.com/gpu.product",
            id="pinned-with-gfd-label",
        ),
    ],
)
def test_warning_names_the_label_to_pin_with(spec: dict[str, Any], pin: str) -> None:
    assert inventory().choose(spec).pin == pin


def test_pinned_to_unknown_model() -> None:
    choice = inventory().choose({"nodeSelector": {"fracgpu.io/gpu.product": "NVIDIA-B200"}})
    assert choice.card is None
    assert "fracgpu.io/gpu.product=NVIDIA-B200" in choice.unknown


@pytest.mark.parametrize(
    "affinity",
    [
        None,
        {"nodeAffinity": None},
        {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": None}},
        {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {
                            "matchExpressions": [
                                {"key": "fracgpu.io/gpu.product", "operator": "In", "values": ["A"]}
                            ]
                        },
                        {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["z"]}]},
                    ]
                }
            }
        },
        {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [None, "x", {"matchExpressions": "y"}]
                }
            }
        },
    ],
    ids=["none", "no node affinity", "no required terms", "one term unpinned", "malformed terms"],
)
def test_not_pinned(affinity: Any) -> None:
    assert pinned_products({"affinity": affinity}) is None


def test_nothing_known() -> None:
    choice = Inventory().choose({})
    assert choice.card is None
    assert choice.unknown == "no GPU models are known to fracgpu"


def test_choice_is_kept_until_gpu_labels_change() -> None:
    inv = inventory()
    first = inv.choose({})
    assert inv.choose({}) is first
    inv.set_node("h1", {**H100, "topology.kubernetes.io/zone": "b"})  # not a GPU label
    inv.set_node("cpu", {"kubernetes.io/os": "linux", "extra": "1"})
    assert inv.choose({}) is first
    inv.set_node("l1", {**L4_GFD, "nvidia.com/gpu.memory": "24000"})
    assert inv.choose({}) is not first
    assert inv.models()["NVIDIA-L4"].memory_mib == 24000
    before = inv.choose({})
    inv.remove_node("gone")  # unknown: nothing changes
    assert inv.choose({}) is before
    inv.remove_node("h1")
    assert inv.choose({}).largest == GpuModel("NVIDIA-L4", 24000)
    inv.replace_nodes([("h1", H100)])
    assert inv.choose({}).card == GpuModel("Static-GPU", 16384)
    assert inv.choose({}).largest == GpuModel("NVIDIA-H100-80GB-HBM3", 81559)


def test_pinned_choices_are_cached_per_pin_and_bounded() -> None:
    from webhook.inventory import _MAX_CHOICES

    inv = inventory()
    pin = {"nodeSelector": {"fracgpu.io/gpu.product": "NVIDIA-H100-80GB-HBM3"}}
    assert inv.choose(pin) is inv.choose(copy.deepcopy(pin))
    for i in range(_MAX_CHOICES + 10):  # pins are user input
        choice = inv.choose({"nodeSelector": {"fracgpu.io/gpu.product": f"model-{i}"}})
        assert choice.card is None
        assert f"model-{i}" in choice.unknown
    assert len(inv._choices) <= _MAX_CHOICES
    assert inv.choose(pin).card == GpuModel("NVIDIA-H100-80GB-HBM3", 81559)


@pytest.mark.parametrize(
    ("products", "mib"),
    [
        pytest.param(None, 81920, id="unpinned: the largest model"),
        pytest.param(frozenset({"T4"}), 15360, id="pinned to one model"),
        pytest.param(frozenset({"T4", "A100"}), 81920, id="pinned to two: the larger"),
        pytest.param(frozenset({"H100"}), None, id="a model nobody has"),
    ],
)
def test_largest_card_for_quota(products: frozenset[str] | None, mib: int | None) -> None:
    inventory = Inventory({"T4": 15360, "A100": 81920})
    assert inventory.largest_card_mib(products) == mib


@pytest.mark.parametrize(
    ("spec", "chosen", "products"),
    [
        pytest.param(
            {},
            ModelSet(frozenset({"nvidia-l4"})),
            ["NVIDIA-L4"],
            id="chosen-by-annotation",
        ),
        pytest.param(
            {},
            ModelSet(excluded=frozenset({"Static-GPU"})),
            ["NVIDIA-L4", "NVIDIA-H100-80GB-HBM3"],
            id="all-but-the-excluded",
        ),
        pytest.param(
            {"nodeSelector": {"fracgpu.io/gpu.product": "NVIDIA-H100-80GB-HBM3"}},
            ModelSet(frozenset({"NVIDIA-H100-80GB-HBM3", "NVIDIA-L4"})),
            ["NVIDIA-H100-80GB-HBM3"],
            id="pin-and-annotation-both-apply",
        ),
        pytest.param({}, ModelSet(frozenset({"NVIDIA B200"})), [], id="nothing-known-chosen"),
    ],
)
def test_a_model_choice_narrows_the_candidates(
    spec: dict[str, Any], chosen: ModelSet, products: list[str]
) -> None:
    choice = inventory().choose(spec, chosen)
    assert [c.product for c in choice.cards] == products


@pytest.mark.parametrize(
    ("chosen", "mib"),
    [
        pytest.param(ModelSet(frozenset({"t4"})), 15360, id="only-the-small-model"),
        pytest.param(ModelSet(excluded=frozenset({"A100"})), 15360, id="large-model-excluded"),
    ],
)
def test_largest_card_for_quota_among_chosen_models(chosen: ModelSet, mib: int) -> None:
    assert Inventory({"T4": 15360, "A100": 81920}).largest_card_mib(chosen) == mib
