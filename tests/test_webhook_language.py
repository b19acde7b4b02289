"""The request language's parts, each on its own: the vocabularies in force
(webhook/dialects.py), how messages quote values (webhook/wording.py), each vocabulary read into
one ContainerAsk (webhook/parsing.py), GPU models and the candidates a pod may land on
(webhook/gpumodels.py), and sizing with the defaults (webhook/sizing.py). Whole containers
through normalise_container are tests/test_webhook_resources.py's."""

from __future__ import annotations

from typing import Any

import pytest

from core import dra
from core.policy import Priority
from core.units import Grant
from webhook.dialects import (
    ALWAYS_ON,
    DIALECT_OF,
    DIALECT_RESOURCES,
    OPTIONAL_DIALECTS,
    Dialect,
    enabled,
    input_resources,
)
from webhook.gpumodels import CardChoice, GpuModel
from webhook.parsing import ContainerAsk, RequestError, card_hundredths, parse_ask
from webhook.sizing import check_count, resolve, several_cards_need_dra
from webhook.wording import container_ref, quote, show

L4 = GpuModel("NVIDIA-L4", 23034)  # 89 blocks
H100 = GpuModel("NVIDIA-H100-80GB-HBM3", 81559)  # 318 blocks
ALL = enabled([Dialect.HAMI, Dialect.TKESTACK])


# --- webhook/dialects.py ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("switched_on", "expected"),
    [
        pytest.param(
            [], (Dialect.FRACGPU, Dialect.CANONICAL, Dialect.DEVICE_CLASS), id="always-on-only"
        ),
        pytest.param(
            [Dialect.HAMI],
            (Dialect.FRACGPU, Dialect.CANONICAL, Dialect.HAMI, Dialect.DEVICE_CLASS),
            id="hami-in-dialect-order",
        ),
        pytest.param(
            [Dialect.TKESTACK, Dialect.FRACGPU],
            (Dialect.FRACGPU, Dialect.CANONICAL, Dialect.TKESTACK, Dialect.DEVICE_CLASS),
            id="an-always-on-one-named-again",
        ),
    ],
)
def test_dialects_in_force(switched_on: list[Dialect], expected: tuple[Dialect, ...]) -> None:
    assert enabled(switched_on) == expected


@pytest.mark.parametrize(
    ("switched_on", "resource", "read"),
    [
        pytest.param([], "fracgpu.io/gpu", True, id="ours"),
        pytest.param([], "fracgpu.io/core", True, id="canonical"),
        pytest.param([], dra.DEVICE_CLASS_RESOURCE, True, id="device-class"),
        pytest.param([], "nvidia.com/gpu", False, id="hami-off"),
        pytest.param([Dialect.HAMI], "nvidia.com/gpu", True, id="hami-on"),
        pytest.param([Dialect.TKESTACK], "tencent.com/vcuda-core", True, id="tkestack-on"),
        pytest.param([Dialect.HAMI], "cpu", False, id="not-a-gpu-resource"),
    ],
)
def test_resources_the_webhook_reads(switched_on: list[Dialect], resource: str, read: bool) -> None:
    assert (resource in input_resources(switched_on)) is read


def test_every_resource_belongs_to_one_dialect() -> None:
    assert set(Dialect) == ALWAYS_ON | OPTIONAL_DIALECTS
    for dialect, names in DIALECT_RESOURCES.items():
        assert all(DIALECT_OF[name] is dialect for name in names)


# --- webhook/wording.py ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        pytest.param("1500m", "1.5", id="milli-read-back"),
        pytest.param("8Gi", "8Gi", id="binary-kept"),
        pytest.param(0.5, "0.5", id="number"),
        pytest.param(2, "2", id="integer"),
        pytest.param(True, "true", id="bool-quoted-as-json"),
        pytest.param("abc", '"abc"', id="not-a-quantity"),
        pytest.param([1], "[1]", id="a-list"),
    ],
)
def test_show(raw: Any, shown: str) -> None:
    assert show(raw) == shown


@pytest.mark.parametrize(
    ("raw", "quoted"),
    [
        pytest.param("a", '"a"', id="text"),
        pytest.param(None, "null", id="null"),
        pytest.param(10**5000, f"a number of {(10**5000).bit_length()} bits", id="huge-integer"),
    ],
)
def test_quote(raw: Any, quoted: str) -> None:
    assert quote(raw) == quoted


def test_quote_shortens_what_it_refuses() -> None:
    text = quote("x" * 5000)
    assert text.endswith("… (5002 characters)")
    assert len(text) < 5000


def test_container_ref_names_the_container_as_json() -> None:
    assert container_ref('tr"ain') == 'container "tr\\"ain"'


# --- webhook/parsing.py ----------------------------------------------------------------------

GPU_KEY = "fracgpu.io/gpu"


@pytest.mark.parametrize(
    ("asked", "expected"),
    [
        pytest.param(
            {GPU_KEY: "0.3"},
            ContainerAsk(30, core_key=GPU_KEY, core_shown="0.3"),
            id="fracgpu-fraction",
        ),
        pytest.param({GPU_KEY: "0"}, None, id="fracgpu-zero-is-no-gpu"),
        pytest.param(
            {"fracgpu.io/gpumem": "8Gi"}, ContainerAsk(memory_mib=8192), id="fracgpu-memory-only"
        ),
        pytest.param(
            {GPU_KEY: "0.3", "fracgpu.io/gpu-count": "2"},
            ContainerAsk(
                30, core_key=GPU_KEY, core_shown="0.3", count=2, count_key="fracgpu.io/gpu-count"
            ),
            id="fracgpu-share-of-several-cards",
        ),
        pytest.param(
            {"fracgpu.io/core": "200", "fracgpu.io/memory": "10"},
            ContainerAsk(
                200, memory_blocks=5, exact=True, core_key="fracgpu.io/core", core_shown="200"
            ),
            id="canonical-memory-per-card",
        ),
        pytest.param({"nvidia.com/gpu": "1"}, ContainerAsk(core=100), id="hami-default-card"),
        pytest.param(
            {"nvidia.com/gpu": "1", "nvidia.com/gpucores": "30", "nvidia.com/priority": "0"},
            ContainerAsk(30, ceiling=100, priority=Priority.HIGH),
            id="hami-priority-bursts",
        ),
        pytest.param(
            {"tencent.com/vcuda-core": "50", "tencent.com/vcuda-memory": "8"},
            ContainerAsk(50, memory_blocks=8, core_key="tencent.com/vcuda-core", core_shown="50"),
            id="tkestack",
        ),
        pytest.param(
            {dra.DEVICE_CLASS_RESOURCE: "2"},
            ContainerAsk(200, core_key=dra.DEVICE_CLASS_RESOURCE, core_shown="2"),
            id="device-class-whole-cards",
        ),
    ],
)
def test_parse_ask(asked: dict[str, Any], expected: ContainerAsk | None) -> None:
    assert parse_ask("c", asked, ALL) == expected


@pytest.mark.parametrize(
    ("asked", "message"),
    [
        pytest.param(
            {GPU_KEY: "0.3", "nvidia.com/gpu": "1"},
            'container "c": mixes resources of different vocabularies (fracgpu.io/gpu and '
            "nvidia.com/gpu); use one of them per container",
            id="two-vocabularies",
        ),
        pytest.param(
            {"fracgpu.io/gpumem": "8Gi", "fracgpu.io/gpumem-percentage": "50"},
            'container "c": fracgpu.io/gpumem and fracgpu.io/gpumem-percentage are both set; '
            "give GPU memory one way, either in MiB or as a percentage",
            id="memory-two-ways",
        ),
        pytest.param(
            {GPU_KEY: "abc"},
            'container "c": fracgpu.io/gpu must be a fraction between 0.01 and 1 with at most '
            'two decimals, or a whole number of cards; got "abc"',
            id="not-a-number",
        ),
    ],
)
def test_parse_ask_refuses(asked: dict[str, Any], message: str) -> None:
    with pytest.raises(RequestError) as caught:
        parse_ask("c", asked, ALL)
    assert str(caught.value) == message


@pytest.mark.parametrize(
    ("raw", "hundredths"),
    [
        pytest.param("0.3", 30, id="fraction"),
        pytest.param("300m", 30, id="milli"),
        pytest.param("2", 200, id="whole-cards"),
        pytest.param("0", None, id="zero-is-none"),
    ],
)
def test_card_hundredths(raw: str, hundredths: int | None) -> None:
    assert card_hundredths("c", GPU_KEY, raw) == hundredths


# --- webhook/gpumodels.py --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("choice", "blocks", "smallest", "largest", "fitting"),
    [
        pytest.param(CardChoice(), 10, None, None, None, id="no-candidate"),
        pytest.param(CardChoice((L4,)), 10, L4, L4, L4, id="one-model"),
        pytest.param(CardChoice((L4, H100)), 10, L4, H100, L4, id="smallest-holds-it"),
        pytest.param(CardChoice((L4, H100)), 100, L4, H100, H100, id="only-the-largest-holds-it"),
        pytest.param(CardChoice((L4, H100)), 1000, L4, H100, L4, id="none-holds-it"),
    ],
)
def test_card_choice(
    choice: CardChoice,
    blocks: int,
    smallest: GpuModel | None,
    largest: GpuModel | None,
    fitting: GpuModel | None,
) -> None:
    assert (choice.card, choice.largest, choice.fitting(blocks)) == (smallest, largest, fitting)


@pytest.mark.parametrize(
    ("choice", "used", "warned"),
    [
        pytest.param(CardChoice((L4,)), L4, False, id="one-size"),
        pytest.param(CardChoice((L4, GpuModel("L4-again", 23034))), L4, False, id="same-size"),
        pytest.param(CardChoice((L4, H100)), L4, True, id="sizes-differ"),
    ],
)
def test_card_choice_warns_when_sizes_differ(
    choice: CardChoice, used: GpuModel, warned: bool
) -> None:
    warning = choice.warning(used)
    assert (warning is not None) is warned
    if warning is not None:
        assert warning.startswith(f"sized for {used.product} ({used.memory_mib} MiB), the smallest")


# --- webhook/sizing.py -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ask", "choice", "grant", "warnings"),
    [
        pytest.param(ContainerAsk(30), CardChoice((H100,)), Grant(30, 95), 0, id="fraction"),
        pytest.param(ContainerAsk(200), CardChoice(), Grant(200, 0), 0, id="whole-cards-no-model"),
        pytest.param(
            ContainerAsk(200, memory_mib=8192),
            CardChoice(),
            Grant(200, 0),
            1,
            id="whole-cards-memory-ignored",
        ),
        pytest.param(
            ContainerAsk(30, memory_mib=1000),
            CardChoice(),
            Grant(30, 4),
            1,
            id="memory-rounded-up-to-blocks",
        ),
        pytest.param(
            ContainerAsk(memory_mib=8192),
            CardChoice((H100,)),
            Grant(11, 32),
            0,
            id="memory-only-gets-compute",
        ),
        pytest.param(
            ContainerAsk(memory_percent=50),
            CardChoice((L4, H100)),
            Grant(50, 44),
            1,
            id="percentage-of-the-smallest",
        ),
    ],
)
def test_resolve(ask: ContainerAsk, choice: CardChoice, grant: Grant, warnings: int) -> None:
    said: list[str] = []
    assert resolve("c", ask, choice, 16, said) == grant
    assert len(said) == warnings


@pytest.mark.parametrize(
    ("ask", "choice", "message"),
    [
        pytest.param(
            ContainerAsk(30),
            CardChoice(),
            'container "c": cannot work out GPU memory for the request',
            id="fraction-needs-a-model",
        ),
        pytest.param(
            ContainerAsk(2000, core_key=GPU_KEY, core_shown="20"),
            CardChoice(),
            'container "c": fracgpu.io/gpu asks for more whole cards than a node has',
            id="too-many-cards",
        ),
        pytest.param(
            ContainerAsk(30, memory_mib=200000),
            CardChoice((H100,)),
            'container "c": asks for 200192 MiB of GPU memory per card, more than '
            "NVIDIA-H100-80GB-HBM3 has",
            id="more-memory-than-the-largest",
        ),
    ],
)
def test_resolve_refuses(ask: ContainerAsk, choice: CardChoice, message: str) -> None:
    with pytest.raises(RequestError) as caught:
        resolve("c", ask, choice, 16, [])
    assert str(caught.value).startswith(message)


@pytest.mark.parametrize(
    ("count", "refused"),
    [
        pytest.param(2, False, id="within"),
        pytest.param(16, False, id="at-the-bound"),
        pytest.param(17, True, id="beyond"),
    ],
)
def test_check_count(count: int, refused: bool) -> None:
    ask = ContainerAsk(30, count=count, count_key="fracgpu.io/gpu-count")
    if refused:
        with pytest.raises(RequestError, match="at most 16 cards"):
            check_count("c", ask, 16)
    else:
        check_count("c", ask, 16)


def test_several_cards_need_dra_says_so_in_the_users_terms() -> None:
    message = several_cards_need_dra("c", ContainerAsk(30, count=2, count_key="nvidia.com/gpu"))
    assert message.startswith(
        'container "c": asks for a share of each of 2 cards (nvidia.com/gpu: 2); '
        "in device-plugin mode"
    )
