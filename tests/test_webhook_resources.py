"""The request language and the canonical form: tables of cases, then properties."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core import dra
from core.labels import (
    HAMI_EXCLUDE_ANNOTATION,
    HAMI_MODEL_ANNOTATION,
    MODEL_ANNOTATION,
    MODEL_EXCLUDE_ANNOTATION,
    ModelChoiceError,
    ModelSet,
    choose_models,
    model_lists,
)
from core.policy import Priority
from core.quantity import parse_quantity
from core.units import BLOCK_MIB, CORE, MEMORY, Grant, card_blocks
from webhook.config import AdmissionConfig
from webhook.dialects import Dialect
from webhook.gpumodels import CardChoice, GpuModel
from webhook.parsing import ContainerAsk
from webhook.resources import normalise_container
from webhook.sizing import DEFAULT_MAX_CARDS

H100 = GpuModel("NVIDIA-H100-80GB-HBM3", 81559)  # 318 blocks
L4 = GpuModel("NVIDIA-L4", 23034)  # 89 blocks
KNOWN = CardChoice((H100,))
UNKNOWN = CardChoice()
MIXED = CardChoice((L4, H100))
ALL = (Dialect.HAMI, Dialect.TKESTACK)


def grant_of(limits: dict[str, Any], card: CardChoice = KNOWN, **kw: Any) -> Grant | None:
    result = normalise_container("train", {"limits": limits, **kw}, ALL, card)
    assert not result.errors, result.errors
    return result.grant


def error_of(limits: dict[str, Any], card: CardChoice = KNOWN, **kw: Any) -> str:
    result = normalise_container("train", {"limits": limits, **kw}, ALL, card)
    assert result.grant is None
    assert len(result.errors) == 1, result.errors
    return result.errors[0]


VALID = [
    # (limits, core, blocks); blocks 0: whole cards with all the memory of the cards
    pytest.param({"fracgpu.io/gpu": "0.3"}, 30, 318 * 30 // 100, id="fraction"),
    pytest.param({"fracgpu.io/gpu": "300m"}, 30, 95, id="fraction-milli"),
    pytest.param({"fracgpu.io/gpu": "0.30"}, 30, 95, id="fraction-trailing-zero"),
    pytest.param({"fracgpu.io/gpu": 0.3}, 30, 95, id="fraction-yaml-float"),
    pytest.param({"fracgpu.io/gpu": "0.01"}, 1, 3, id="smallest-share"),
    pytest.param({"fracgpu.io/gpu": "10m"}, 1, 3, id="smallest-share-milli"),
    pytest.param({"fracgpu.io/gpu": "1e-2"}, 1, 3, id="smallest-share-exponent"),
    pytest.param({"fracgpu.io/gpu": "0.56"}, 56, 178, id="fraction-two-decimals"),
    pytest.param({"fracgpu.io/gpu": "1"}, 100, 0, id="one-card"),
    pytest.param({"fracgpu.io/gpu": 2}, 200, 0, id="two-cards-yaml-int"),
    pytest.param({"fracgpu.io/gpu": "8"}, 800, 0, id="eight-cards"),
    pytest.param({"fracgpu.io/gpu": "16"}, 1600, 0, id="max-cards"),
    pytest.param({"fracgpu.io/gpu": "0.5", "fracgpu.io/gpumem": "8192"}, 50, 32, id="mib"),
    pytest.param({"fracgpu.io/gpu": "0.5", "fracgpu.io/gpumem": "8Gi"}, 50, 32, id="bytes"),
    pytest.param(
        {"fracgpu.io/gpu": "0.5", "fracgpu.io/gpumem": "8k"}, 50, 32, id="mib-decimal-suffix"
    ),
    pytest.param({"fracgpu.io/gpu": "0.5", "fracgpu.io/gpumem": 3000}, 50, 12, id="mib-rounded"),
    pytest.param(
        {"fracgpu.io/gpu": "0.5", "fracgpu.io/gpumem-percentage": 50}, 50, 159, id="percentage"
    ),
    pytest.param(
        {"fracgpu.io/gpu": "0.2", "fracgpu.io/gpumem-percentage": "100"}, 20, 318, id="all-memory"
    ),
    pytest.param({"fracgpu.io/gpumem": "8Gi"}, 11, 32, id="memory-only"),
    pytest.param({"fracgpu.io/gpumem-percentage": 25}, 25, 79, id="percentage-only"),
    pytest.param({"fracgpu.io/core": "30", "fracgpu.io/memory": "95"}, 30, 95, id="canonical"),
    pytest.param({"fracgpu.io/core": "200"}, 200, 0, id="canonical-whole-cards"),
    pytest.param(
        {"fracgpu.io/core": "200", "fracgpu.io/memory": "636"},
        200,
        636,
        id="canonical-whole-cards-with-memory-kept",
    ),
    pytest.param(
        {"fracgpu.io/core": "100", "fracgpu.io/memory": "96"},
        100,
        96,
        id="canonical-whole-card-with-other-memory-kept",
    ),
    pytest.param({"fracgpu.io/core": "40"}, 40, 127, id="canonical-core-only"),
    pytest.param(
        {"nvidia.com/gpu": "1", "nvidia.com/gpucores": "30", "nvidia.com/gpumem": "3000"},
        30,
        12,
        id="hami-share",
    ),
    pytest.param({"nvidia.com/gpu": "1"}, 100, 0, id="hami-one-card"),
    pytest.param({"nvidia.com/gpu": "2"}, 200, 0, id="hami-two-cards"),
    pytest.param(
        {"nvidia.com/gpu": "2", "nvidia.com/gpucores": "100"}, 200, 0, id="hami-two-full-cards"
    ),
    pytest.param({"fracgpu.io/gpu": "1", "fracgpu.io/gpu-count": "3"}, 300, 0, id="count-of-ones"),
    pytest.param({"fracgpu.io/gpu": "0.3", "fracgpu.io/gpu-count": "1"}, 30, 95, id="count-one"),
    pytest.param(
        {"nvidia.com/gpu": "1", "nvidia.com/gpumem-percentage": "50"}, 50, 159, id="hami-percent"
    ),
    pytest.param(
        {"tencent.com/vcuda-core": "50", "tencent.com/vcuda-memory": "30"}, 50, 30, id="tke-share"
    ),
    pytest.param({"tencent.com/vcuda-core": "200"}, 200, 0, id="tke-two-cards"),
    pytest.param({dra.DEVICE_CLASS_RESOURCE: "1"}, 100, 0, id="device-class-one-card"),
    pytest.param({dra.DEVICE_CLASS_RESOURCE: 2}, 200, 0, id="device-class-two-cards-yaml-int"),
]


@pytest.mark.parametrize(("limits", "core", "blocks"), VALID)
def test_valid(limits: dict[str, Any], core: int, blocks: int) -> None:
    assert grant_of(limits) == Grant(core, blocks)


GPU_RULE = (
    'container "train": fracgpu.io/gpu must be a fraction between 0.01 and 1 with at most two '
    "decimals, or a whole number of cards; got "
)

INVALID = [
    pytest.param({"fracgpu.io/gpu": "1.5"}, GPU_RULE + "1.5", id="one-and-a-half"),
    pytest.param(
        {dra.DEVICE_CLASS_RESOURCE: "0.5"},
        f"{dra.DEVICE_CLASS_RESOURCE} must be a whole number of cards; got 0.5",
        id="device-class-share",
    ),
    pytest.param(
        {dra.DEVICE_CLASS_RESOURCE: "1", "fracgpu.io/gpumem": "8Gi"},
        "mixes resources of different vocabularies",
        id="device-class-with-memory",
    ),
    pytest.param({"fracgpu.io/gpu": "1500m"}, GPU_RULE + "1.5", id="one-and-a-half-milli"),
    pytest.param({"fracgpu.io/gpu": "2.7"}, GPU_RULE + "2.7", id="two-point-seven"),
    pytest.param({"fracgpu.io/gpu": "0.333"}, GPU_RULE + "0.333", id="three-decimals"),
    pytest.param({"fracgpu.io/gpu": "0.005"}, GPU_RULE + "0.005", id="below-smallest-share"),
    pytest.param({"fracgpu.io/gpu": "-1"}, GPU_RULE + "-1", id="negative-cards"),
    pytest.param({"fracgpu.io/gpu": "-0.5"}, GPU_RULE + "-0.5", id="negative-share"),
    pytest.param({"fracgpu.io/gpu": "abc"}, GPU_RULE + '"abc"', id="not-a-number"),
    pytest.param({"fracgpu.io/gpu": True}, GPU_RULE + "true", id="boolean"),
    pytest.param({"fracgpu.io/gpu": "1Gi"}, GPU_RULE + "1Gi", id="binary-cards"),
    pytest.param(
        {"fracgpu.io/gpu": "0.5", "fracgpu.io/gpumem": "0.5"},
        "whole number of MiB",
        id="fractional-mib",
    ),
    pytest.param(
        {"fracgpu.io/gpu": "0.5", "fracgpu.io/gpumem": "1536Ki"},
        "got 1536Ki",
        id="bytes-not-whole-mib",
    ),
    pytest.param(
        {"fracgpu.io/gpu": "0.5", "fracgpu.io/gpumem": "-5"},
        "whole number of MiB",
        id="negative-mib",
    ),
    pytest.param(
        {"fracgpu.io/gpu": "0.5", "fracgpu.io/gpumem": "100Gi"},
        "more than NVIDIA-H100-80GB-HBM3",
        id="more-memory-than-the-card",
    ),
    pytest.param(
        {"fracgpu.io/gpu": "0.5", "fracgpu.io/gpumem": "8000000000"},
        "write a binary suffix",
        id="bytes-as-mib",
    ),
    pytest.param(
        {"fracgpu.io/gpu": "0.5", "fracgpu.io/gpumem-percentage": "0"},
        "between 1 and 100; got 0",
        id="zero-percent",
    ),
    pytest.param(
        {"fracgpu.io/gpu": "0.5", "fracgpu.io/gpumem-percentage": "101"},
        "got 101",
        id="percent-over-100",
    ),
    pytest.param(
        {"fracgpu.io/gpu": "0.5", "fracgpu.io/gpumem-percentage": "50.5"},
        "got 50.5",
        id="fractional-percent",
    ),
    pytest.param(
        {"fracgpu.io/gpu": "0.5", "fracgpu.io/gpumem": "8Gi", "fracgpu.io/gpumem-percentage": 5},
        "are both set",
        id="mib-and-percent",
    ),
    pytest.param(
        {"fracgpu.io/gpu": "0", "fracgpu.io/gpumem": "8Gi"},
        "is 0 but GPU memory is requested",
        id="zero-cards-with-memory",
    ),
    pytest.param({"fracgpu.io/core": "150"}, "multiple of 100", id="canonical-core-not-whole"),
    pytest.param(
        {"fracgpu.io/core": "30", "fracgpu.io/memory": "0"},
        "at least 1 block",
        id="canonical-zero-memory",
    ),
    pytest.param(
        {"fracgpu.io/gpu": "0.5", "fracgpu.io/core": "50"},
        "mixes resources",
        id="mixes-fracgpu-and-canonical",
    ),
    pytest.param(
        {"fracgpu.io/gpu": "0.5", "nvidia.com/gpumem": "1000"},
        "mixes resources",
        id="mixes-fracgpu-and-hami",
    ),
    pytest.param(
        {"nvidia.com/gpu": "2", "nvidia.com/gpucores": "30"},
        "asks for a share of each of 2 cards (nvidia.com/gpu: 2); in device-plugin mode a "
        "container gets a share of one card or whole cards, and only DRA mode",
        id="hami-share-of-two-cards",
    ),
    pytest.param(
        {"fracgpu.io/gpu": "0.3", "fracgpu.io/gpu-count": "2"},
        "asks for a share of each of 2 cards (fracgpu.io/gpu-count: 2); in device-plugin mode",
        id="share-of-two-cards-in-device-plugin-mode",
    ),
    pytest.param(
        {"fracgpu.io/gpu": "2", "fracgpu.io/gpu-count": "2"},
        "fracgpu.io/gpu 2 is whole cards, and fracgpu.io/gpu-count says on how many cards a "
        "share is given",
        id="count-with-whole-cards",
    ),
    pytest.param(
        {"fracgpu.io/gpu-count": "2"},
        "fracgpu.io/gpu-count is set without a share to give on each card",
        id="count-alone",
    ),
    pytest.param(
        {"fracgpu.io/gpu": "0.3", "fracgpu.io/gpu-count": "0"},
        "fracgpu.io/gpu-count must be a whole number of cards, at least 1; got 0",
        id="count-zero",
    ),
    pytest.param(
        {"fracgpu.io/gpu": "0.3", "fracgpu.io/gpu-count": "1.5"},
        "fracgpu.io/gpu-count must be a whole number of cards; got 1.5",
        id="count-fraction",
    ),
    pytest.param(
        {"fracgpu.io/gpu": "0", "fracgpu.io/gpu-count": "2"},
        "fracgpu.io/gpu is 0 but fracgpu.io/gpu-count is requested",
        id="count-of-nothing",
    ),
    pytest.param(
        {"nvidia.com/gpu": "1", "nvidia.com/gpucores": "130"},
        "between 0 and 100",
        id="hami-cores-over-100",
    ),
    pytest.param({"tencent.com/vcuda-core": "150"}, "multiple of 100", id="tke-core-not-whole"),
    pytest.param(
        {"fracgpu.io/gpu": "17"},
        "fracgpu.io/gpu asks for more whole cards than a node has: a container may have at "
        "most 16 cards (admission.max_cards); got 17; ask for fewer cards",
        id="cards-over-bound",
    ),
    pytest.param(
        {"fracgpu.io/gpu": "1e30"},
        "most 16 cards (admission.max_cards); got 1000000000000000000000000000000;",
        id="cards-absurd",
    ),
    pytest.param(
        {"fracgpu.io/core": "1e30"},
        "fracgpu.io/core asks for more whole cards",
        id="canonical-cards-absurd",
    ),
    pytest.param(
        {"nvidia.com/gpu": "1000"},
        "nvidia.com/gpu asks for more whole cards than a node has",
        id="hami-cards-absurd",
    ),
    pytest.param(
        {"tencent.com/vcuda-core": "1e25"},
        "tencent.com/vcuda-core asks for more whole cards",
        id="tke-cards-absurd",
    ),
    pytest.param({"fracgpu.io/gpu": "1" * 5000}, "… (5002 characters)", id="cards-5000-digits"),
    pytest.param(
        {"fracgpu.io/gpu": "0.5", "fracgpu.io/gpumem": "9" * 4400},
        "whole number of MiB",
        id="mib-4400-digits",
    ),
    pytest.param(
        {"fracgpu.io/core": "2" * 4301}, "hundredths of a card", id="canonical-4301-digits"
    ),
    pytest.param(
        {"fracgpu.io/gpu": 10**5000}, "got a number of 16610 bits", id="yaml-int-5000-digits"
    ),
]


@pytest.mark.parametrize(("limits", "expected"), INVALID)
def test_invalid(limits: dict[str, Any], expected: str) -> None:
    message = error_of(limits)
    assert message.startswith('container "train": ')
    assert expected in message


def test_exact_example_message() -> None:
    assert error_of({"fracgpu.io/gpu": "1.5"}) == (
        'container "train": fracgpu.io/gpu must be a fraction between 0.01 and 1 with at most two '
        "decimals, or a whole number of cards; got 1.5"
    )


def test_requests_must_equal_limits_except_a_shares_burst() -> None:
    message = error_of({"fracgpu.io/gpumem": "8Gi"}, requests={"fracgpu.io/gpumem": "4Gi"})
    assert message.startswith(
        'container "train": fracgpu.io/gpumem request 4Gi differs from its limit 8Gi; set only '
        "limits, or make requests equal to limits"
    )
    assert grant_of({"fracgpu.io/gpu": "0.5"}, requests={"fracgpu.io/gpu": "500m"}) == Grant(
        50, 159
    )


def test_requests_without_limits() -> None:
    result = normalise_container("t", {"requests": {"fracgpu.io/gpu": "0.5"}}, (), KNOWN)
    assert result.errors == [
        'container "t": fracgpu.io/gpu is set in requests (0.5) but not in limits; GPU resources '
        "are set in limits (requests may be omitted)"
    ]


def test_zero_means_no_gpu() -> None:
    result = normalise_container("t", {"limits": {"fracgpu.io/gpu": "0"}}, (), KNOWN)
    assert result.grant is None
    assert not result.errors
    assert result.zero


def test_dialects_off_by_default() -> None:
    result = normalise_container("t", {"limits": {"nvidia.com/gpu": "1"}}, (), KNOWN)
    assert result.grant is None
    assert not result.mentions_gpu


@pytest.mark.parametrize(
    "limits",
    [
        pytest.param({"fracgpu.io/gpu": "0.3"}, id="fraction"),
        pytest.param({"fracgpu.io/gpumem": "8Gi"}, id="memory-only"),
        pytest.param(
            {"fracgpu.io/gpu": "0.3", "fracgpu.io/gpumem-percentage": "10"}, id="percentage"
        ),
    ],
)
def test_needs_card_when_unknown(limits: dict[str, Any]) -> None:
    message = error_of(limits, UNKNOWN)
    assert "no GPU models are known to fracgpu" in message


def test_unknown_card_message_says_how_to_fix() -> None:
    assert "inventory.models" in error_of({"fracgpu.io/gpu": "0.3"}, UNKNOWN)


@pytest.mark.parametrize(
    ("limits", "core"),
    [
        pytest.param({"fracgpu.io/gpu": "1"}, 100, id="one-card"),
        pytest.param({"fracgpu.io/gpu": "2"}, 200, id="two-cards"),
        pytest.param({"fracgpu.io/core": "400"}, 400, id="canonical"),
        pytest.param({"nvidia.com/gpu": "1"}, 100, id="hami"),
        pytest.param({"tencent.com/vcuda-core": "300"}, 300, id="tke"),
        pytest.param(
            {"fracgpu.io/gpu": "1", "fracgpu.io/gpumem-percentage": "100"}, 100, id="all-memory"
        ),
    ],
)
@pytest.mark.parametrize(
    "card",
    [
        pytest.param(UNKNOWN, id="no-model-known"),
        pytest.param(MIXED, id="two-models"),
        pytest.param(KNOWN, id="one-model"),
    ],
)
def test_whole_cards_need_no_model_and_carry_no_memory(
    limits: dict[str, Any], core: int, card: CardChoice
) -> None:
    assert grant_of(limits, card) == Grant(core, 0)


@pytest.mark.parametrize(
    "card",
    [pytest.param(UNKNOWN, id="no-model-known"), pytest.param(MIXED, id="two-models")],
)
def test_whole_cards_are_admitted_without_a_warning(card: CardChoice) -> None:
    result = normalise_container("t", {"limits": {GPU: "2"}}, (), card)
    assert result.warnings == []


def test_canonical_whole_cards_with_memory_need_no_model() -> None:
    assert grant_of({CORE: "200", MEMORY: "636"}, UNKNOWN) == Grant(200, 636)


@pytest.mark.parametrize(
    ("limits", "card"),
    [
        pytest.param(
            {"fracgpu.io/gpu": "0.5", "fracgpu.io/gpumem": "8000000000"}, UNKNOWN, id="no-model"
        ),
        pytest.param({"fracgpu.io/core": "30", "fracgpu.io/memory": "1e30"}, KNOWN, id="canonical"),
        pytest.param(
            {"fracgpu.io/core": "200", "fracgpu.io/memory": "9000"}, UNKNOWN, id="canonical-cards"
        ),
    ],
)
def test_memory_no_gpu_has_is_denied_even_without_a_model(
    limits: dict[str, Any], card: CardChoice
) -> None:
    assert "more than any GPU has (1048576 MiB usable)" in error_of(limits, card)


def test_canonical_memory_is_not_held_to_the_models_known_now() -> None:
    """Sized when first admitted; the model that holds it may be scaled to zero now."""
    assert grant_of({CORE: "50", MEMORY: "159"}, CardChoice((L4,))) == Grant(50, 159)


def test_explicit_memory_needs_no_inventory() -> None:
    assert grant_of({"fracgpu.io/gpu": "0.3", "fracgpu.io/gpumem": "8Gi"}, UNKNOWN) == Grant(30, 32)


def test_rounding_warns() -> None:
    result = normalise_container("t", {"limits": {GPU: "0.5", GPUMEM: "3000"}}, (), KNOWN)
    assert result.warnings == [
        'container "t": 3000 MiB of GPU memory rounded up to 3072 MiB (GPU memory is granted in '
        "256 MiB blocks)"
    ]


GPU, GPUMEM = "fracgpu.io/gpu", "fracgpu.io/gpumem"


@pytest.mark.parametrize(
    "limits",
    [
        pytest.param({GPU: "1", GPUMEM: "8Gi"}, id="mib"),
        pytest.param({GPU: "2", "fracgpu.io/gpumem-percentage": "50"}, id="percentage"),
        pytest.param(
            {"nvidia.com/gpu": "1", "nvidia.com/gpucores": "100", "nvidia.com/gpumem": "8000"},
            id="hami",
        ),
        pytest.param({"tencent.com/vcuda-core": "100", "tencent.com/vcuda-memory": "4"}, id="tke"),
    ],
)
def test_whole_cards_ignore_memory_limit_with_warning(limits: dict[str, Any]) -> None:
    result = normalise_container("t", {"limits": limits}, ALL, KNOWN)
    assert result.grant is not None
    assert result.grant.memory_blocks == 0
    assert result.warnings == [
        'container "t": whole cards come with all of their memory; the memory limit is ignored'
    ]


def test_max_cards_is_configurable() -> None:
    result = normalise_container("t", {"limits": {GPU: "4"}}, (), KNOWN, max_cards=2)
    assert result.errors == [
        'container "t": fracgpu.io/gpu asks for more whole cards than a node has: a container '
        "may have at most 2 cards (admission.max_cards); got 4; ask for fewer cards"
    ]


def test_unpinned_mixed_cluster_sizes_fractions_for_the_smallest_and_warns() -> None:
    result = normalise_container("t", {"limits": {GPU: "0.5"}}, (), MIXED)
    assert result.grant == Grant(50, card_blocks(L4.memory_mib) // 2)
    assert result.warnings == [
        'container "t": sized for NVIDIA-L4 (23034 MiB), the smallest of 2 GPU models it may '
        "land on; pin a model with nodeSelector fracgpu.io/gpu.product to size for another"
    ]


def test_explicit_memory_is_bounded_by_the_largest_and_needs_no_warning() -> None:
    result = normalise_container("t", {"limits": {GPU: "0.5", GPUMEM: "40Gi"}}, (), MIXED)
    assert (result.grant, result.warnings) == (Grant(50, 160), [])


@pytest.mark.parametrize(
    ("mib", "grant", "sized_for"),
    [
        pytest.param(8192, Grant(36, 32), "NVIDIA-L4", id="fits-the-smallest"),
        # 96 blocks do not fit an L4 (89): sized as 31 % of an H100, not as a whole L4.
        pytest.param(24576, Grant(31, 96), "NVIDIA-H100-80GB-HBM3", id="only-the-largest"),
    ],
)
def test_memory_only_is_sized_for_the_smallest_model_that_holds_it(
    mib: int, grant: Grant, sized_for: str
) -> None:
    result = normalise_container("t", {"limits": {GPUMEM: str(mib)}}, (), MIXED)
    assert result.grant == grant
    assert result.warnings[0].startswith(f'container "t": sized for {sized_for} ')


def test_proportional_shares_always_fit_one_card() -> None:
    for core in range(1, 101):
        for other in range(1, 101 - core):
            a = grant_of({GPU: str(Decimal(core) / 100)})
            b = grant_of({GPU: str(Decimal(other) / 100)})
            assert a is not None
            assert b is not None
            assert a.memory_blocks + b.memory_blocks <= card_blocks(H100.memory_mib)


@pytest.mark.parametrize(
    ("grant", "env"),
    [
        pytest.param(
            Grant(30, 95),
            {"FRACGPU_GPU": "0.3", "FRACGPU_MEMORY_MIB": str(95 * BLOCK_MIB)},
            id="share",
        ),
        pytest.param(
            Grant(200, 636),
            {"FRACGPU_GPU": "2", "FRACGPU_MEMORY_MIB": str(318 * BLOCK_MIB)},
            id="whole-cards-with-memory-per-card",
        ),
        pytest.param(Grant(200, 0), {"FRACGPU_GPU": "2"}, id="whole-cards-memory-from-the-node"),
    ],
)
def test_grant_env(grant: Grant, env: dict[str, str]) -> None:
    assert grant.env() == env


@pytest.mark.parametrize(
    ("resources", "grant"),
    [
        pytest.param({CORE: "30", MEMORY: "95"}, Grant(30, 95), id="share"),
        pytest.param({CORE: "200"}, Grant(200, 0), id="whole-cards"),
        pytest.param({CORE: "200", MEMORY: "636"}, Grant(200, 636), id="whole-cards-with-memory"),
        pytest.param({CORE: "30"}, None, id="share-without-memory"),
        pytest.param({CORE: "x", MEMORY: "1"}, None, id="malformed"),
        pytest.param({MEMORY: "1"}, None, id="memory-only"),
    ],
)
def test_grant_from_resources(resources: dict[str, str], grant: Grant | None) -> None:
    assert Grant.from_resources(resources) == grant


@pytest.mark.parametrize(
    "grant", [Grant(30, 95), Grant(200, 0), Grant(200, 636)], ids=["share", "whole", "old-whole"]
)
def test_grant_resources_round_trip(grant: Grant) -> None:
    assert Grant.from_resources(grant.resources()) == grant


# Properties ---------------------------------------------------------------------------------

fractions = st.integers(1, 100).map(lambda k: Decimal(k) / 100)
wholes = st.integers(1, 8).map(Decimal)


def spellings(value: Decimal) -> st.SearchStrategy[Any]:
    text = format(value.normalize(), "f")
    options: list[Any] = [text, f"{int(value * 1000)}m", float(text)]
    if value == value.to_integral_value():
        options += [int(value), f"{int(value)}"]
    return st.sampled_from(options)


memory = st.one_of(
    st.none(),
    st.integers(1, 81000).map(lambda m: (GPUMEM, m)),
    st.integers(1, 79).map(lambda g: (GPUMEM, f"{g}Gi")),
    st.integers(1, 100).map(lambda p: ("fracgpu.io/gpumem-percentage", p)),
)


@settings(max_examples=300, deadline=None)
@given(
    cards=st.one_of(fractions, wholes).flatmap(spellings), mem=memory, with_requests=st.booleans()
)
def test_every_valid_input_normalises_to_kubernetes_legal_integers(
    cards: Any, mem: tuple[str, Any] | None, with_requests: bool
) -> None:
    limits: dict[str, Any] = {GPU: cards}
    if mem is not None:
        limits[mem[0]] = mem[1]
    resources: dict[str, Any] = {"limits": limits}
    if with_requests:
        resources["requests"] = dict(limits)
    result = normalise_container("c", resources, (), KNOWN)
    assert not result.errors, result.errors
    assert result.grant is not None
    canonical = result.grant.resources()
    for value in canonical.values():
        q = parse_quantity(value)
        assert q.is_integer
        assert q.value >= 1
    core = result.grant.core
    assert 1 <= core <= 100 or core % 100 == 0
    assert result.grant.memory_blocks <= max(core // 100, 1) * card_blocks(H100.memory_mib)
    # Re-admitting the canonical output gives the same grant (idempotence).
    again = normalise_container("c", {"limits": canonical}, (), KNOWN)
    assert again.grant == result.grant
    assert not again.errors


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=12),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children)
    ),
    max_leaves=8,
)
keys = st.sampled_from(
    [GPU, GPUMEM, "fracgpu.io/gpumem-percentage", CORE, MEMORY, "nvidia.com/gpu", "cpu"]
)


@settings(max_examples=400, deadline=None)
@given(
    resources=st.one_of(
        json_values,
        st.fixed_dictionaries(
            {"limits": st.dictionaries(keys, json_values | st.text(max_size=8), max_size=4)},
            optional={"requests": st.dictionaries(keys, json_values, max_size=3)},
        ),
    ),
    card=st.sampled_from([KNOWN, UNKNOWN, MIXED]),
)
def test_nothing_raises_and_bad_input_is_denied(resources: Any, card: CardChoice) -> None:
    result = normalise_container("c", resources, ALL, card)
    if result.grant is not None:
        assert not result.errors
        assert all(parse_quantity(v).is_integer for v in result.grant.resources().values())


@settings(max_examples=200, deadline=None)
@given(
    value=st.one_of(
        st.decimals(min_value=Decimal("-10"), max_value=Decimal("10"), places=3),
        st.text(max_size=6),
    )
)
def test_invalid_gpu_values_are_denied(value: Any) -> None:
    try:
        q = parse_quantity(value if isinstance(value, str) else str(value))
        valid = q.format == "decimal" and (
            (0 < q.value <= 1 and (q.value * 100) % 1 == 0)
            or (1 <= q.value <= DEFAULT_MAX_CARDS and q.is_integer)
        )
        zero = q.value == 0
    except ValueError:
        valid, zero = False, False
    result = normalise_container("c", {"limits": {GPU: str(value)}}, (), KNOWN)
    if valid:
        assert result.grant is not None
    elif zero:
        assert result.zero
    else:
        assert result.errors
        assert result.grant is None


@pytest.mark.parametrize("value", [0, 17], ids=["none", "more-than-a-limits-file-names"])
def test_max_cards_configuration_is_bounded(value: int) -> None:
    with pytest.raises(ValueError, match="max_cards"):
        AdmissionConfig(max_cards=value)


@pytest.mark.parametrize(
    ("limits", "ask"),
    [
        pytest.param(
            {"fracgpu.io/gpu": "0.3", "fracgpu.io/gpumem": "8Gi", "fracgpu.io/gpu-count": "2"},
            ContainerAsk(
                30,
                8192,
                core_key="fracgpu.io/gpu",
                core_shown="0.3",
                count=2,
                count_key="fracgpu.io/gpu-count",
            ),
            id="fracgpu",
        ),
        pytest.param(
            {"fracgpu.io/gpumem": "8Gi", "fracgpu.io/gpu-count": "2"},
            ContainerAsk(memory_mib=8192, count=2, count_key="fracgpu.io/gpu-count"),
            id="memory-only",
        ),
        pytest.param(
            {"nvidia.com/gpu": "2", "nvidia.com/gpumem": "8000"},
            ContainerAsk(memory_mib=8000, count=2, count_key="nvidia.com/gpu"),
            id="hami-memory-of-each",
        ),
        pytest.param(
            {"nvidia.com/gpu": "4", "nvidia.com/gpucores": "25", "nvidia.com/gpumem": "8000"},
            ContainerAsk(25, 8000, count=4, count_key="nvidia.com/gpu"),
            id="hami-share-of-each",
        ),
    ],
)
def test_a_share_of_several_cards_is_asked_in_dra_mode(
    limits: dict[str, Any], ask: ContainerAsk
) -> None:
    result = normalise_container("train", {"limits": limits}, ALL, KNOWN, sized=False)
    assert (result.errors, result.ask) == ([], ask)


def test_a_share_of_more_cards_than_a_container_may_have_is_denied_in_dra_mode() -> None:
    limits = {"fracgpu.io/gpu": "0.3", "fracgpu.io/gpu-count": "17"}
    result = normalise_container("train", {"limits": limits}, ALL, KNOWN, sized=False)
    assert result.errors == [
        'container "train": fracgpu.io/gpu-count asks for a share of 17 cards; a container may '
        "have at most 16 cards (admission.max_cards); ask for fewer"
    ]


# Choosing the GPU model in pod annotations (core.labels; issue #28 item 4).
A100 = "NVIDIA A100-SXM4-40GB"
H100_NAME = "NVIDIA H100 80GB HBM3"
CLUSTER = [A100, H100_NAME]


@pytest.mark.parametrize(
    ("annotations", "hami", "only", "excluded"),
    [
        pytest.param({MODEL_ANNOTATION: A100}, False, {A100}, set(), id="exact"),
        pytest.param(
            {MODEL_ANNOTATION: "nvidia a100-sxm4-40gb"}, False, {A100}, set(), id="any-case"
        ),
        pytest.param(
            {MODEL_ANNOTATION: "NVIDIA-H100-80GB-HBM3"},
            False,
            {H100_NAME},
            set(),
            id="label-spelling",
        ),
        pytest.param(
            {MODEL_ANNOTATION: f" {A100} , {H100_NAME} "},
            False,
            {A100, H100_NAME},
            set(),
            id="two-with-spaces",
        ),
        pytest.param({MODEL_EXCLUDE_ANNOTATION: A100}, False, None, {A100}, id="exclude"),
        pytest.param(
            {MODEL_ANNOTATION: f"{A100},{H100_NAME}", MODEL_EXCLUDE_ANNOTATION: H100_NAME},
            False,
            {A100},
            set(),
            id="exclude-narrows-the-list",
        ),
        pytest.param({HAMI_MODEL_ANNOTATION: "a100"}, True, {A100}, set(), id="hami-part-of-name"),
        pytest.param({HAMI_EXCLUDE_ANNOTATION: "H100"}, True, None, {H100_NAME}, id="hami-exclude"),
        pytest.param(
            {HAMI_MODEL_ANNOTATION: "NVIDIA", MODEL_ANNOTATION: H100_NAME},
            True,
            {H100_NAME},
            set(),
            id="fracgpu-and-hami-combine",
        ),
        pytest.param({HAMI_MODEL_ANNOTATION: "A100"}, False, None, None, id="hami-off-ignored"),
        pytest.param({"other": "x"}, False, None, None, id="no-choice"),
    ],
)
def test_model_choice_is_matched_against_known_models(
    annotations: dict[str, Any],
    hami: bool,
    only: set[str] | None,
    excluded: set[str] | None,
) -> None:
    chosen = choose_models(*model_lists(annotations, hami=hami), CLUSTER, strict=True)
    if excluded is None:
        assert chosen is None
        return
    assert chosen is not None
    assert chosen.only == (None if only is None else frozenset(only))
    assert chosen.excluded == frozenset(excluded)


@pytest.mark.parametrize(
    ("annotations", "expected"),
    [
        pytest.param(
            {MODEL_ANNOTATION: "H1000"},
            f"{MODEL_ANNOTATION} 'H1000' matches no GPU model in this cluster",
            id="unknown",
        ),
        pytest.param(
            {MODEL_ANNOTATION: "H1000"},
            f"known: {A100}, {H100_NAME}; write one of them, comma-separated",
            id="unknown-lists-the-known",
        ),
        pytest.param(
            {MODEL_EXCLUDE_ANNOTATION: "T4"},
            f"{MODEL_EXCLUDE_ANNOTATION} 'T4' matches no GPU model",
            id="unknown-excluded",
        ),
        pytest.param(
            {MODEL_EXCLUDE_ANNOTATION: f"{A100},{H100_NAME}"},
            "no GPU model of this cluster is left",
            id="excludes-every-model",
        ),
        pytest.param(
            {MODEL_ANNOTATION: A100, MODEL_EXCLUDE_ANNOTATION: A100},
            "allow at least one of them, or exclude fewer",
            id="excludes-what-it-chose",
        ),
        pytest.param({MODEL_ANNOTATION: ""}, "is empty", id="empty"),
        pytest.param({MODEL_ANNOTATION: " "}, "is empty", id="blank"),
        pytest.param({MODEL_ANNOTATION: f"{A100},,{H100_NAME}"}, "empty entry", id="double-comma"),
        pytest.param({MODEL_ANNOTATION: f"{A100},"}, "empty entry", id="trailing-comma"),
        pytest.param({MODEL_ANNOTATION: f"{A100},{A100.lower()}"}, "twice", id="duplicate"),
        pytest.param({MODEL_ANNOTATION: 7}, "must be a string", id="not-a-string"),
        pytest.param({MODEL_ANNOTATION: ["A"]}, "must be a string", id="a-list"),
        pytest.param({MODEL_ANNOTATION: "x" * 200}, "at most 128", id="entry-too-long"),
        pytest.param(
            {MODEL_ANNOTATION: ",".join(f"m{i}" for i in range(40))}, "40 models", id="many"
        ),
        pytest.param(
            {HAMI_MODEL_ANNOTATION: "B200"},
            f"{HAMI_MODEL_ANNOTATION} 'B200' matches no GPU model",
            id="hami-unknown",
        ),
        pytest.param(
            {HAMI_MODEL_ANNOTATION: "B200"}, "parts of a GPU product name", id="hami-says-its-rule"
        ),
    ],
)
def test_model_choice_errors_name_the_annotation_value_and_fix(
    annotations: dict[str, Any], expected: str
) -> None:
    with pytest.raises(ModelChoiceError) as caught:
        choose_models(*model_lists(annotations, hami=True), CLUSTER, strict=True)
    assert expected in str(caught.value)


@pytest.mark.parametrize(
    ("annotations", "only"),
    [
        pytest.param({MODEL_ANNOTATION: "NVIDIA B200"}, {"NVIDIA B200"}, id="kept-as-written"),
        pytest.param(
            {MODEL_ANNOTATION: f"{A100.lower()},NVIDIA B200"},
            {A100, "NVIDIA B200"},
            id="known-ones-take-the-cluster-spelling",
        ),
    ],
)
def test_model_choice_of_an_admitted_pod_is_not_held_to_the_models_known_now(
    annotations: dict[str, Any], only: set[str]
) -> None:
    chosen = choose_models(*model_lists(annotations), CLUSTER, strict=False)
    assert chosen is not None
    assert chosen.only == frozenset(only)


def test_model_choice_with_no_known_model_is_kept_as_written() -> None:
    chosen = choose_models(*model_lists({MODEL_ANNOTATION: "NVIDIA B200"}), [], strict=True)
    assert chosen == ModelSet(frozenset({"NVIDIA B200"}))


def test_hami_model_choice_cannot_be_matched_with_no_known_model() -> None:
    with pytest.raises(ModelChoiceError, match="write the exact product name in"):
        choose_models(*model_lists({HAMI_MODEL_ANNOTATION: "A100"}, hami=True), [], strict=True)


@pytest.mark.parametrize(
    ("product", "inside"),
    [
        pytest.param(A100, True, id="same"),
        pytest.param("NVIDIA-A100-SXM4-40GB", True, id="label-spelling"),
        pytest.param("nvidia a100-sxm4-40gb", True, id="other-case"),
        pytest.param("NVIDIA A100-SXM4-80GB", False, id="other-model"),
        pytest.param(7, False, id="not-a-string"),
    ],
)
def test_model_set_membership_compares_spellings(product: object, inside: bool) -> None:
    assert (product in ModelSet(frozenset({A100}))) is inside


# ---- burst and priority: requests below limits, HAMi's nvidia.com/priority ----------------------


@pytest.mark.parametrize(
    ("resources", "core", "ceiling", "priority"),
    [
        pytest.param(
            {"requests": {"fracgpu.io/gpu": "0.3"}, "limits": {"fracgpu.io/gpu": "1"}},
            30, 100, None, id="guaranteed-0.3-bursting-to-the-card",
        ),
        pytest.param(
            {"requests": {"fracgpu.io/gpu": "300m"}, "limits": {"fracgpu.io/gpu": "0.6",
                                                                "fracgpu.io/gpumem": "8Gi"}},
            30, 60, None, id="guaranteed-0.3-bursting-to-0.6-with-memory",
        ),
        pytest.param(
            {"limits": {"fracgpu.io/gpu": "0.3"}}, 30, 0, None, id="limits-alone-a-hard-cap",
        ),
        pytest.param(
            {"requests": {"fracgpu.io/gpu": "0.3"}, "limits": {"fracgpu.io/gpu": "0.30"}},
            30, 0, None, id="equal-spellings-a-hard-cap",
        ),
        pytest.param(
            {"limits": {"nvidia.com/gpu": "1", "nvidia.com/gpucores": "30",
                        "nvidia.com/priority": "0"}},
            30, 100, Priority.HIGH, id="hami-high-priority",
        ),
        pytest.param(
            {"limits": {"nvidia.com/gpu": "1", "nvidia.com/gpucores": "30",
                        "nvidia.com/priority": "1"}},
            30, 100, Priority.LOW, id="hami-low-priority",
        ),
        pytest.param(
            {"limits": {"nvidia.com/gpu": "1", "nvidia.com/gpucores": "30"}},
            30, 0, None, id="hami-without-priority-a-hard-cap",
        ),
    ],
)  # fmt: skip
def test_a_share_may_burst_from_its_request_to_its_limit(
    resources: dict[str, Any], core: int, ceiling: int, priority: Priority | None
) -> None:
    result = normalise_container("train", resources, ALL, KNOWN)
    assert result.errors == []
    assert result.ask is not None and result.grant is not None
    assert (result.grant.core, result.ask.ceiling, result.ask.priority) == (
        core,
        ceiling,
        priority,
    )


def test_the_request_annotation_keeps_the_limit_a_share_bursts_to() -> None:
    resources = {"requests": {"fracgpu.io/gpu": "0.3"}, "limits": {"fracgpu.io/gpu": "1"}}
    result = normalise_container("train", resources, ALL, KNOWN)
    assert result.request == {"fracgpu.io/gpu": "0.3", "limits.fracgpu.io/gpu": "1"}


@pytest.mark.parametrize(
    ("resources", "expected"),
    [
        pytest.param(
            {"requests": {"fracgpu.io/gpu": "0.5"}, "limits": {"fracgpu.io/gpu": "0.3"}},
            'container "train": fracgpu.io/gpu request 0.5 is more than its limit 0.3: '
            "fracgpu.io/gpu in requests is the share's guarantee and in limits the most it may "
            "burst to, both shares of one card (0.01–1), the request below the limit",
            id="request-above-limit",
        ),
        pytest.param(
            {"requests": {"fracgpu.io/gpu": "0.5"}, "limits": {"fracgpu.io/gpu": "2"}},
            "whole cards are never throttled, so give them in limits alone",
            id="bursting-to-whole-cards",
        ),
        pytest.param(
            {"requests": {"fracgpu.io/gpu": "0.5", "fracgpu.io/gpumem": "4Gi"},
             "limits": {"fracgpu.io/gpu": "1", "fracgpu.io/gpumem": "8Gi"}},
            "GPU memory is never lent, since an allocation cannot be taken back",
            id="memory-is-never-lent",
        ),
        pytest.param(
            {"limits": {"nvidia.com/gpu": "1", "nvidia.com/gpucores": "30",
                        "nvidia.com/priority": "2"}},
            'container "train": nvidia.com/priority must be 0 (high) or 1 (low); got 2',
            id="hami-priority-out-of-range",
        ),
    ],
)  # fmt: skip
def test_a_burst_that_is_not_one_is_denied(resources: dict[str, Any], expected: str) -> None:
    result = normalise_container("train", resources, ALL, KNOWN)
    assert len(result.errors) == 1
    assert expected in result.errors[0]


def test_a_hami_priority_without_a_gpu_is_denied_not_a_whole_card() -> None:
    result = normalise_container("train", {"limits": {"nvidia.com/priority": "0"}}, ALL, KNOWN)
    assert result.errors == [
        'container "train": nvidia.com/priority is set without a GPU; it orders shares of a '
        "card, so add nvidia.com/gpu (and nvidia.com/gpucores or nvidia.com/gpumem), or remove it"
    ]
