"""The request language and the canonical form: tables of cases, then properties."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.quantity import parse_quantity
from core.units import BLOCK_MIB, CORE, MEMORY, Grant, card_blocks
from webhook.resources import Card, CardChoice, Dialect, normalise_container

H100 = Card("NVIDIA-H100-80GB-HBM3", 81559)  # 318 blocks
L4 = Card("NVIDIA-L4", 23034)  # 89 blocks
KNOWN = CardChoice(H100, H100)
UNKNOWN = CardChoice(None)
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
    # (limits, core, blocks)
    ({"fracgpu.io/gpu": "0.3"}, 30, 318 * 30 // 100),
    ({"fracgpu.io/gpu": "300m"}, 30, 95),
    ({"fracgpu.io/gpu": "0.30"}, 30, 95),
    ({"fracgpu.io/gpu": 0.3}, 30, 95),
    ({"fracgpu.io/gpu": "0.01"}, 1, 3),
    ({"fracgpu.io/gpu": "10m"}, 1, 3),
    ({"fracgpu.io/gpu": "1e-2"}, 1, 3),
    ({"fracgpu.io/gpu": "0.56"}, 56, 178),
    ({"fracgpu.io/gpu": "1"}, 100, 318),
    ({"fracgpu.io/gpu": 2}, 200, 636),
    ({"fracgpu.io/gpu": "8"}, 800, 8 * 318),
    ({"fracgpu.io/gpu": "0.5", "fracgpu.io/gpumem": "8192"}, 50, 32),
    ({"fracgpu.io/gpu": "0.5", "fracgpu.io/gpumem": "8Gi"}, 50, 32),
    ({"fracgpu.io/gpu": "0.5", "fracgpu.io/gpumem": "8k"}, 50, 32),  # 8000 MiB, rounded up
    ({"fracgpu.io/gpu": "0.5", "fracgpu.io/gpumem": 3000}, 50, 12),
    ({"fracgpu.io/gpu": "0.5", "fracgpu.io/gpumem-percentage": 50}, 50, 159),
    ({"fracgpu.io/gpu": "0.2", "fracgpu.io/gpumem-percentage": "100"}, 20, 318),
    ({"fracgpu.io/gpumem": "8Gi"}, 11, 32),  # memory only: a share of at least 32/318
    ({"fracgpu.io/gpumem-percentage": 25}, 25, 79),
    ({"fracgpu.io/core": "30", "fracgpu.io/memory": "95"}, 30, 95),  # canonical passes through
    ({"fracgpu.io/core": "200", "fracgpu.io/memory": "636"}, 200, 636),
    ({"fracgpu.io/core": "40"}, 40, 127),
    ({"nvidia.com/gpu": "1", "nvidia.com/gpucores": "30", "nvidia.com/gpumem": "3000"}, 30, 12),
    ({"nvidia.com/gpu": "1"}, 100, 318),
    ({"nvidia.com/gpu": "2"}, 200, 636),
    ({"nvidia.com/gpu": "1", "nvidia.com/gpumem-percentage": "50"}, 50, 159),
    ({"tencent.com/vcuda-core": "50", "tencent.com/vcuda-memory": "30"}, 50, 30),
    ({"tencent.com/vcuda-core": "200"}, 200, 636),
]


@pytest.mark.parametrize(("limits", "core", "blocks"), VALID)
def test_valid(limits: dict[str, Any], core: int, blocks: int) -> None:
    assert grant_of(limits) == Grant(core, blocks)


GPU_RULE = (
    'container "train": fracgpu.io/gpu must be a fraction between 0.01 and 1 with at most two '
    "decimals, or a whole number of cards; got "
)

INVALID = [
    ({"fracgpu.io/gpu": "1.5"}, GPU_RULE + "1.5"),
    ({"fracgpu.io/gpu": "1500m"}, GPU_RULE + "1.5"),
    ({"fracgpu.io/gpu": "2.7"}, GPU_RULE + "2.7"),
    ({"fracgpu.io/gpu": "0.333"}, GPU_RULE + "0.333"),
    ({"fracgpu.io/gpu": "0.005"}, GPU_RULE + "0.005"),
    ({"fracgpu.io/gpu": "-1"}, GPU_RULE + "-1"),
    ({"fracgpu.io/gpu": "-0.5"}, GPU_RULE + "-0.5"),
    ({"fracgpu.io/gpu": "abc"}, GPU_RULE + '"abc"'),
    ({"fracgpu.io/gpu": True}, GPU_RULE + "true"),
    ({"fracgpu.io/gpu": "1Gi"}, GPU_RULE + "1Gi"),
    ({"fracgpu.io/gpu": "0.5", "fracgpu.io/gpumem": "0.5"}, "whole number of MiB"),
    ({"fracgpu.io/gpu": "0.5", "fracgpu.io/gpumem": "1536Ki"}, "got 1536Ki"),
    ({"fracgpu.io/gpu": "0.5", "fracgpu.io/gpumem": "-5"}, "whole number of MiB"),
    ({"fracgpu.io/gpu": "0.5", "fracgpu.io/gpumem": "100Gi"}, "more than NVIDIA-H100-80GB-HBM3"),
    ({"fracgpu.io/gpu": "0.5", "fracgpu.io/gpumem": "8000000000"}, "write a binary suffix"),
    ({"fracgpu.io/gpu": "0.5", "fracgpu.io/gpumem-percentage": "0"}, "between 1 and 100; got 0"),
    ({"fracgpu.io/gpu": "0.5", "fracgpu.io/gpumem-percentage": "101"}, "got 101"),
    ({"fracgpu.io/gpu": "0.5", "fracgpu.io/gpumem-percentage": "50.5"}, "got 50.5"),
    (
        {"fracgpu.io/gpu": "0.5", "fracgpu.io/gpumem": "8Gi", "fracgpu.io/gpumem-percentage": 5},
        "are both set",
    ),
    ({"fracgpu.io/gpu": "0", "fracgpu.io/gpumem": "8Gi"}, "is 0 but GPU memory is requested"),
    ({"fracgpu.io/core": "150"}, "multiple of 100"),
    ({"fracgpu.io/core": "30", "fracgpu.io/memory": "0"}, "at least 1 block"),
    ({"fracgpu.io/gpu": "0.5", "fracgpu.io/core": "50"}, "mixes resources"),
    ({"fracgpu.io/gpu": "0.5", "nvidia.com/gpumem": "1000"}, "mixes resources"),
    ({"nvidia.com/gpu": "2", "nvidia.com/gpucores": "30"}, "share of one card or whole cards"),
    ({"nvidia.com/gpu": "1", "nvidia.com/gpucores": "130"}, "between 0 and 100"),
    ({"tencent.com/vcuda-core": "150"}, "multiple of 100"),
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


def test_requests_must_equal_limits() -> None:
    message = error_of({"fracgpu.io/gpu": "0.5"}, requests={"fracgpu.io/gpu": "0.3"})
    assert message == (
        'container "train": fracgpu.io/gpu request 0.3 differs from its limit 0.5; set only '
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
    assert result.grant is None and not result.errors and result.zero


def test_dialects_off_by_default() -> None:
    result = normalise_container("t", {"limits": {"nvidia.com/gpu": "1"}}, (), KNOWN)
    assert result.grant is None and not result.mentions_gpu


@pytest.mark.parametrize(
    "limits",
    [
        {"fracgpu.io/gpu": "0.3"},
        {"fracgpu.io/gpu": "2"},
        {"fracgpu.io/gpumem": "8Gi"},
        {"fracgpu.io/gpu": "0.3", "fracgpu.io/gpumem-percentage": "10"},
    ],
)
def test_needs_card_when_unknown(limits: dict[str, Any]) -> None:
    message = error_of(limits, UNKNOWN)
    assert "no GPU models are known to fracgpu" in message
    assert "inventory.models" in message


def test_explicit_memory_needs_no_inventory() -> None:
    assert grant_of({"fracgpu.io/gpu": "0.3", "fracgpu.io/gpumem": "8Gi"}, UNKNOWN) == Grant(30, 32)


def test_rounding_warns() -> None:
    result = normalise_container("t", {"limits": {GPU: "0.5", GPUMEM: "3000"}}, (), KNOWN)
    assert result.warnings == [
        'container "t": 3000 MiB of GPU memory rounded up to 3072 MiB (GPU memory is granted in '
        "256 MiB blocks)"
    ]


GPU, GPUMEM = "fracgpu.io/gpu", "fracgpu.io/gpumem"


def test_whole_cards_ignore_memory_limit_with_warning() -> None:
    result = normalise_container("t", {"limits": {GPU: "1", GPUMEM: "8Gi"}}, (), KNOWN)
    assert result.grant == Grant(100, 318)
    assert "whole cards come with all of their memory" in result.warnings[0]


def test_unpinned_mixed_cluster_uses_smallest_and_warns() -> None:
    choice = CardChoice(L4, H100, warning="sized for NVIDIA-L4")
    result = normalise_container("t", {"limits": {GPU: "0.5"}}, (), choice)
    assert result.grant == Grant(50, card_blocks(L4.memory_mib) // 2)
    assert result.warnings == ['container "t": sized for NVIDIA-L4']
    # Explicit memory is bounded by the largest candidate, and needs no sizing: no warning.
    result = normalise_container("t", {"limits": {GPU: "0.5", GPUMEM: "40Gi"}}, (), choice)
    assert result.grant == Grant(50, 160) and result.warnings == []


def test_proportional_shares_always_fit_one_card() -> None:
    for core in range(1, 101):
        for other in range(1, 101 - core):
            a = grant_of({GPU: str(Decimal(core) / 100)})
            b = grant_of({GPU: str(Decimal(other) / 100)})
            assert a is not None and b is not None
            assert a.memory_blocks + b.memory_blocks <= card_blocks(H100.memory_mib)


def test_grant_env_and_round_trip() -> None:
    grant = Grant(30, 95)
    assert grant.env() == {"FRACGPU_GPU": "0.3", "FRACGPU_MEMORY_MIB": str(95 * BLOCK_MIB)}
    assert Grant(200, 636).env()["FRACGPU_MEMORY_MIB"] == str(318 * BLOCK_MIB)
    assert Grant.from_resources(grant.resources()) == grant
    assert Grant.from_resources({CORE: "x", MEMORY: "1"}) is None


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
        assert q.is_integer and q.value >= 1  # Kubernetes: extended resources are integers
    core = result.grant.core
    assert 1 <= core <= 100 or core % 100 == 0
    assert result.grant.memory_blocks <= max(core // 100, 1) * card_blocks(H100.memory_mib)
    # Re-admitting the canonical output gives the same grant (idempotence).
    again = normalise_container("c", {"limits": canonical}, (), KNOWN)
    assert again.grant == result.grant and not again.errors


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
    card=st.sampled_from([KNOWN, UNKNOWN, CardChoice(L4, H100, "w")]),
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
            (0 < q.value <= 1 and (q.value * 100) % 1 == 0) or (q.value >= 1 and q.is_integer)
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
        assert result.errors and result.grant is None
