"""Pod demand as Kubernetes computes pod requests (init containers, sidecars), and terminality."""

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from core.labels import PRODUCT_LABEL
from quota.demand import CardMemory, Demand, is_terminal, pod_demand
from testkit.quota_pods import container, gpu_pod, plain_pod


def test_sum_of_app_containers() -> None:
    pod = gpu_pod("p", 30, 10)
    pod["spec"]["containers"].append(container("b", 20, 6))
    assert pod_demand(pod) == Demand(50, 16 * 256)


def test_largest_init_container_wins_when_larger() -> None:
    pod = gpu_pod("p", 30, 10, init=[container("i1", 100, 80), container("i2", 20, 2)])
    assert pod_demand(pod) == Demand(100, 80 * 256)


def test_sidecars_count_with_app_and_before_later_inits() -> None:
    sidecar = container("side", 10, 4, restartPolicy="Always")
    later = container("later", 50, 8)
    pod = gpu_pod("p", 30, 10, init=[sidecar, later])
    # app + sidecar = 40 core, 14 blocks; sidecar + later init = 60 core, 12 blocks.
    assert pod_demand(pod) == Demand(60, 14 * 256)


def test_no_gpu_is_none() -> None:
    assert pod_demand(plain_pod("p")) is None
    assert pod_demand({"spec": "odd"}) is None


def test_pinned_model() -> None:
    pod = gpu_pod("p", node_selector={PRODUCT_LABEL: "A100"})
    demand = pod_demand(pod)
    assert demand is not None
    assert demand.models == frozenset({"A100"})
    assert demand.on("A100")
    assert not demand.on("T4")
    assert Demand(1, 256).on("T4")  # unpinned: may land anywhere


def test_terminal() -> None:
    pod = gpu_pod("p")
    assert not is_terminal(pod)
    pod["status"] = {"phase": "Succeeded"}
    assert is_terminal(pod)
    pod["status"] = {"phase": "Running"}
    at = datetime(2026, 1, 1, tzinfo=UTC)
    pod["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    pod["metadata"]["deletionGracePeriodSeconds"] = 30
    assert not is_terminal(pod, at + timedelta(seconds=29))
    assert is_terminal(pod, at + timedelta(seconds=31))


SIZES = {"A100": 81920, "T4": 15360}


def _card_memory(products: frozenset[str] | None) -> int | None:
    known = [mib for model, mib in SIZES.items() if products is None or model in products]
    return max(known, default=None)


@pytest.mark.parametrize(
    ("pod", "card_memory", "demand"),
    [
        pytest.param(
            gpu_pod("p", 200, 0), _card_memory, Demand(200, 2 * 320 * 256), id="largest card"
        ),
        pytest.param(
            gpu_pod("p", 100, 0, node_selector={PRODUCT_LABEL: "T4"}),
            _card_memory,
            Demand(100, 60 * 256, frozenset({"T4"})),
            id="the pinned model's card",
        ),
        pytest.param(
            gpu_pod("p", 100, 0, node_selector={PRODUCT_LABEL: "H100"}),
            _card_memory,
            Demand(100, 0, frozenset({"H100"}), unsized_cards=1),
            id="a model no node has: unsized",
        ),
        pytest.param(
            gpu_pod("p", 300, 0), None, Demand(300, 0, unsized_cards=3), id="no card known"
        ),
        pytest.param(
            gpu_pod("p", 100, 318), _card_memory, Demand(100, 318 * 256), id="memory as admitted"
        ),
        pytest.param(gpu_pod("p", 30, 10), None, Demand(30, 10 * 256), id="a share needs no card"),
    ],
)
def test_whole_cards_are_charged_the_memory_of_their_card(
    pod: dict[str, Any], card_memory: CardMemory | None, demand: Demand
) -> None:
    assert pod_demand(pod, card_memory) == demand


def chose(pod: dict[str, Any], **annotations: str) -> dict[str, Any]:
    """The pod with model annotations (``only=`` and ``exclude=``)."""
    names = {"only": "fracgpu.io/gpu-model", "exclude": "fracgpu.io/gpu-model-exclude"}
    pod["metadata"]["annotations"] = {names[k]: v for k, v in annotations.items()}
    return pod


@pytest.mark.parametrize(
    ("pod", "model", "counted"),
    [
        pytest.param(chose(gpu_pod("p"), only="A100"), "A100", True, id="chosen-model"),
        pytest.param(chose(gpu_pod("p"), only="A100"), "T4", False, id="other-model"),
        pytest.param(chose(gpu_pod("p"), only="a100"), "A100", True, id="chosen-in-other-case"),
        pytest.param(
            chose(gpu_pod("p"), only="NVIDIA A100-SXM4-40GB"),
            "NVIDIA-A100-SXM4-40GB",
            True,
            id="chosen-in-the-slice-spelling",
        ),
        pytest.param(chose(gpu_pod("p"), only="A100,T4"), "T4", True, id="one-of-two"),
        pytest.param(chose(gpu_pod("p"), exclude="T4"), "T4", False, id="excluded-model"),
        pytest.param(chose(gpu_pod("p"), exclude="T4"), "A100", True, id="not-excluded-model"),
        pytest.param(
            chose(gpu_pod("p", node_selector={PRODUCT_LABEL: "A100"}), only="A100,T4"),
            "T4",
            False,
            id="pin-and-annotation-both-apply",
        ),
        pytest.param(chose(gpu_pod("p"), only="A100,,"), "T4", True, id="invalid-counts-as-absent"),
    ],
)
def test_a_model_chosen_by_annotation_counts_like_a_pin(
    pod: dict[str, Any], model: str, counted: bool
) -> None:
    demand = pod_demand(pod)
    assert demand is not None
    assert demand.on(model) is counted


@pytest.mark.parametrize(
    ("pod", "blocks"),
    [
        pytest.param(chose(gpu_pod("p", 100, 0), only="T4"), 60, id="only-the-small-card"),
        pytest.param(chose(gpu_pod("p", 100, 0), exclude="A100"), 60, id="large-card-excluded"),
        pytest.param(chose(gpu_pod("p", 100, 0), exclude="T4"), 320, id="small-card-excluded"),
    ],
)
def test_whole_cards_are_charged_the_largest_card_among_the_chosen_models(
    pod: dict[str, Any], blocks: int
) -> None:
    demand = pod_demand(pod, _card_memory)
    assert demand is not None
    assert demand.memory_mib == blocks * 256
