"""webhook/claims.py and claimstore.py: the request language as ResourceClaimTemplates (DRA
mode), the models ResourceSlices publish, and the store that keeps the templates.

The templates are checked against Kubernetes 1.36's own schema (kubernetes-validate), so a field
the API server would refuse fails here, not on a cluster.
"""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest

from core import dra
from core.kube import RESOURCE_CLAIM_TEMPLATES, Api, call_json
from core.labels import ModelSet
from webhook.claims import ClaimPlan, SliceModels, TemplateError, plan_claim
from webhook.claimstore import LAST_USED_ANNOTATION, TemplateStore, referenced_templates
from webhook.gpumodels import GpuModel
from webhook.parsing import ContainerAsk, RequestError

SMALL = GpuModel("NVIDIA-L4", 23034)  # 89 blocks
LARGE = GpuModel("NVIDIA-H100-80GB-HBM3", 81559)  # 318 blocks
MODELS = {SMALL.product: SMALL, LARGE.product: LARGE}


def _request(plan: ClaimPlan) -> dict[str, Any]:
    request: dict[str, Any] = plan.template["spec"]["spec"]["devices"]["requests"][0]
    return request


def _capacity(request: dict[str, Any]) -> dict[str, str] | None:
    capacity: dict[str, str] | None = request.get("capacity", {}).get("requests")
    return capacity


# name, ask, models, template name (prefix), exact request or per-model (product, cores, memory)
EXACT = [
    pytest.param(
        ContainerAsk(core=100), {}, "fracgpu-cards-1", {"count": 1}, id="a whole card, no model"
    ),
    pytest.param(
        ContainerAsk(core=300), MODELS, "fracgpu-cards-3", {"count": 3}, id="three whole cards"
    ),
    pytest.param(
        ContainerAsk(core=30, memory_mib=8192),
        {},
        "fracgpu-c30-m8192",
        {"count": 1, "capacity": {"requests": {"cores": "30", "memory": "8192Mi"}}},
        id="a share with its memory needs no model",
    ),
    pytest.param(
        ContainerAsk(core=5, memory_blocks=2),
        {},
        "fracgpu-c5-m512",
        {"count": 1, "capacity": {"requests": {"cores": "5", "memory": "512Mi"}}},
        id="canonical blocks",
    ),
    pytest.param(
        ContainerAsk(core=30, memory_mib=8192, count=2),
        {},
        "fracgpu-c30-m8192-n2",
        {"count": 2, "capacity": {"requests": {"cores": "30", "memory": "8192Mi"}}},
        id="a share of two cards: one request of two distinct cards, charged per card",
    ),
]


@pytest.mark.parametrize(("ask", "models", "name", "request_fields"), EXACT)
def test_exact_requests(
    ask: ContainerAsk, models: dict[str, GpuModel], name: str, request_fields: dict[str, Any]
) -> None:
    plan = plan_claim("c", ask, models, max_cards=16)
    assert plan.name == name
    assert _request(plan) == {
        "name": "gpu",
        "exactly": {"deviceClassName": dra.DEVICE_CLASS, **request_fields},
    }


PER_MODEL = [
    pytest.param(
        ContainerAsk(core=50),
        [(SMALL, "50", "11264Mi"), (LARGE, "50", "40704Mi")],
        id="a fraction gets that fraction of whichever card it lands on",
    ),
    pytest.param(
        ContainerAsk(memory_percent=25),
        [(SMALL, "25", "5632Mi"), (LARGE, "25", "20224Mi")],
        id="a percentage is of the card it lands on",
    ),
    pytest.param(
        ContainerAsk(memory_mib=40960),
        [(LARGE, "51", "40960Mi")],
        id="memory alone: only cards that hold it, with the share of compute to match",
    ),
    pytest.param(
        ContainerAsk(core=10, memory_percent=50),
        [(SMALL, "10", "11264Mi"), (LARGE, "10", "40704Mi")],
        id="a fraction with a percentage of memory",
    ),
]


@pytest.mark.parametrize(("ask", "alternatives"), PER_MODEL)
def test_model_dependent_requests_offer_one_alternative_per_model(
    ask: ContainerAsk, alternatives: list[tuple[GpuModel, str, str]]
) -> None:
    request = _request(plan_claim("c", ask, MODELS, max_cards=16))
    offered = [
        (alt["selectors"][0]["cel"]["expression"], _capacity(alt))
        for alt in request["firstAvailable"]
    ]
    assert offered == [
        (dra.product_selector(card.product), {"cores": cores, "memory": memory})
        for card, cores, memory in alternatives
    ]


def test_a_share_of_several_cards_sized_per_model_asks_for_that_many_of_the_model() -> None:
    plan = plan_claim("c", ContainerAsk(core=50, count=2), MODELS, max_cards=16)
    assert plan.name.startswith("fracgpu-c50-n2-h")
    assert [alt["count"] for alt in _request(plan)["firstAvailable"]] == [2, 2]


def test_a_template_name_changes_when_the_models_change() -> None:
    one = plan_claim("c", ContainerAsk(core=50), {SMALL.product: SMALL}, max_cards=16)
    both = plan_claim("c", ContainerAsk(core=50), MODELS, max_cards=16)
    assert one.name != both.name


def test_rounded_memory_is_said() -> None:
    plan = plan_claim("train", ContainerAsk(core=30, memory_mib=3000), {}, max_cards=16)
    assert _capacity(_request(plan)["exactly"]) == {"cores": "30", "memory": "3072Mi"}
    assert plan.warnings == (
        'container "train": 3000 MiB of GPU memory rounded up to 3072 MiB (GPU memory is '
        "granted in 256 MiB blocks)",
    )


@pytest.mark.parametrize(
    ("ask", "models", "message"),
    [
        pytest.param(ContainerAsk(core=50), {}, "no GPU models are published", id="no model known"),
        pytest.param(
            ContainerAsk(memory_percent=10), {}, "no GPU models are published", id="percent"
        ),
        pytest.param(
            ContainerAsk(memory_mib=200000),
            MODELS,
            "more GPU memory than any card",
            id="too much memory",
        ),
        pytest.param(
            ContainerAsk(core=2000, core_key="fracgpu.io/gpu", core_shown="20"),
            {},
            "more whole cards than a node has",
            id="more cards than admission.max_cards",
        ),
    ],
)
def test_requests_that_cannot_be_sized_are_denied(
    ask: ContainerAsk, models: dict[str, GpuModel], message: str
) -> None:
    with pytest.raises(RequestError, match=message):
        plan_claim("c", ask, models, max_cards=16)


@pytest.mark.parametrize(
    "ask",
    [
        pytest.param(ContainerAsk(core=200), id="whole cards"),
        pytest.param(ContainerAsk(core=30, memory_mib=8192), id="share"),
        pytest.param(ContainerAsk(memory_percent=25), id="first available"),
    ],
)
def test_templates_are_valid_kubernetes_1_36_objects(ask: ContainerAsk) -> None:
    template = dict(plan_claim("c", ask, MODELS, max_cards=16).template)
    template["metadata"] = {**template["metadata"], "namespace": "team-a"}
    kubernetes_validate.validate(template, "1.36.0", strict=True)


# --- a pod's choice of GPU model (fracgpu.io/gpu-model, -exclude) ------------------------------

ONLY_SMALL = ModelSet(frozenset({SMALL.product}))
NOT_SMALL = ModelSet(excluded=frozenset({SMALL.product}))
PRODUCT = f'device.attributes["{dra.DRIVER}"].productName'


@pytest.mark.parametrize(
    ("ask", "chosen", "expression"),
    [
        pytest.param(
            ContainerAsk(core=100), ONLY_SMALL, f'{PRODUCT} in ["NVIDIA-L4"]', id="whole-card-in"
        ),
        pytest.param(
            ContainerAsk(core=200),
            NOT_SMALL,
            f'!({PRODUCT} in ["NVIDIA-L4"])',
            id="whole-cards-not-in",
        ),
        pytest.param(
            ContainerAsk(core=30, memory_mib=8192),
            ModelSet(frozenset({SMALL.product, LARGE.product})),
            f'{PRODUCT} in ["NVIDIA-H100-80GB-HBM3", "NVIDIA-L4"]',
            id="share-with-memory-two-models",
        ),
    ],
)
def test_exact_requests_select_the_chosen_models_by_cel(
    ask: ContainerAsk, chosen: ModelSet, expression: str
) -> None:
    plan = plan_claim("c", ask, MODELS, max_cards=16, chosen=chosen)
    assert _request(plan)["exactly"]["selectors"] == [{"cel": {"expression": expression}}]


@pytest.mark.parametrize(
    ("ask", "chosen"),
    [
        pytest.param(ContainerAsk(core=100), ONLY_SMALL, id="whole-card-only"),
        pytest.param(ContainerAsk(core=100), NOT_SMALL, id="whole-card-exclude"),
        pytest.param(ContainerAsk(core=30, memory_mib=8192), ONLY_SMALL, id="share-with-memory"),
        pytest.param(ContainerAsk(core=50), ONLY_SMALL, id="first-available"),
    ],
)
def test_a_model_choice_changes_the_template_name(ask: ContainerAsk, chosen: ModelSet) -> None:
    models = {SMALL.product: SMALL} if chosen is ONLY_SMALL else MODELS
    plain = plan_claim("c", ask, models, max_cards=16)
    assert plan_claim("c", ask, models, max_cards=16, chosen=chosen).name != plain.name


def test_two_choices_never_share_a_template() -> None:
    one = plan_claim("c", ContainerAsk(core=100), MODELS, max_cards=16, chosen=ONLY_SMALL)
    other = plan_claim("c", ContainerAsk(core=100), MODELS, max_cards=16, chosen=NOT_SMALL)
    assert one.name != other.name


def test_a_template_name_with_a_choice_keeps_its_shape_readable() -> None:
    plan = plan_claim("c", ContainerAsk(core=100), MODELS, max_cards=16, chosen=ONLY_SMALL)
    assert plan.name.startswith("fracgpu-cards-1-g")


def test_the_largest_model_choice_fits_the_cel_limit() -> None:
    names = frozenset(f"{'N' * 120} {i}" for i in range(32))
    expression = dra.products_selector(names, names)
    assert expression is not None
    assert len(expression) <= 10 * 1024


@pytest.mark.parametrize(
    "chosen",
    [pytest.param(ONLY_SMALL, id="only"), pytest.param(NOT_SMALL, id="exclude")],
)
def test_templates_with_a_choice_are_valid_kubernetes_1_36_objects(chosen: ModelSet) -> None:
    template = dict(
        plan_claim("c", ContainerAsk(core=100), MODELS, max_cards=16, chosen=chosen).template
    )
    template["metadata"] = {**template["metadata"], "namespace": "team-a"}
    kubernetes_validate.validate(template, "1.36.0", strict=True)


# --- the store, against the fake API server ---------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


async def _templates(api: Api, namespace: str) -> list[dict[str, Any]]:
    listing = await call_json(api, "GET", RESOURCE_CLAIM_TEMPLATES.path(namespace))
    items: list[dict[str, Any]] = listing["items"]
    return items


async def test_ensure_creates_once_and_never_on_dry_run(team_api: Api) -> None:
    store = TemplateStore(team_api, clock=Clock())
    plan = plan_claim("c", ContainerAsk(core=30, memory_mib=8192), {}, max_cards=16)
    await store.ensure("team-a", plan, dry_run=True)
    assert await _templates(team_api, "team-a") == []
    await store.ensure("team-a", plan, dry_run=False)
    await store.ensure("team-a", plan, dry_run=False)
    assert [t["metadata"]["name"] for t in await _templates(team_api, "team-a")] == [plan.name]


async def test_a_template_another_replica_made_is_touched(team_api: Api) -> None:
    clock = Clock()
    plan = plan_claim("c", ContainerAsk(core=100), {}, max_cards=16)
    await TemplateStore(team_api, clock=clock).ensure("team-a", plan, dry_run=False)
    clock.now += 300
    await TemplateStore(team_api, clock=clock).ensure("team-a", plan, dry_run=False)
    [stored] = await _templates(team_api, "team-a")
    assert stored["metadata"]["annotations"][LAST_USED_ANNOTATION] == str(int(clock.now))


async def test_collect_deletes_only_idle_templates_no_pod_uses(team_api: Api) -> None:
    clock = Clock()
    store = TemplateStore(team_api, grace_s=600, clock=clock)
    used = plan_claim("c", ContainerAsk(core=100), {}, max_cards=16)
    idle = plan_claim("c", ContainerAsk(core=200), {}, max_cards=16)
    fresh = plan_claim("c", ContainerAsk(core=300), {}, max_cards=16)
    await store.ensure("team-a", used, dry_run=False)
    await store.ensure("team-a", idle, dry_run=False)
    clock.now += 601
    await store.ensure("team-a", fresh, dry_run=False)
    deleted = await store.collect({"team-a": {used.name}})
    assert deleted == [f"team-a/{idle.name}"]
    names = sorted(t["metadata"]["name"] for t in await _templates(team_api, "team-a"))
    assert names == sorted([used.name, fresh.name])


def _slice(products: list[tuple[str, str]], driver: str = dra.DRIVER) -> dict[str, Any]:
    return {
        "driver": driver,
        "devices": [
            {
                "name": f"gpu-{i}",
                "attributes": {dra.PRODUCT_ATTRIBUTE: {"string": product}},
                "capacity": {dra.MEMORY: {"value": memory}},
            }
            for i, (product, memory) in enumerate(products)
        ],
    }


@pytest.mark.parametrize(
    ("slices", "models"),
    [
        pytest.param({}, {}, id="no slice"),
        pytest.param(
            {"a": _slice([("L4", "22784Mi")])}, {"L4": GpuModel("L4", 22784)}, id="one model"
        ),
        pytest.param(
            {"a": _slice([("L4", "22784Mi")]), "b": _slice([("L4", "22528Mi")])},
            {"L4": GpuModel("L4", 22528)},
            id="the smallest report of a model wins",
        ),
        pytest.param(
            {"a": _slice([("L4", "22784Mi")], driver="gpu.nvidia.com")},
            {},
            id="another driver's slice is not ours",
        ),
        pytest.param(
            {"a": _slice([("L4", "lots")])}, {}, id="a memory that is not a quantity is skipped"
        ),
    ],
)
def test_models_come_from_the_slices(
    slices: dict[str, dict[str, Any]], models: dict[str, GpuModel]
) -> None:
    known = SliceModels()
    for name, spec in slices.items():
        known.set_slice(name, spec)
    assert known.models() == models


def _on(node: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {**spec, "nodeName": node}


@pytest.mark.parametrize(
    ("slices", "most"),
    [
        pytest.param({}, None, id="no slice"),
        pytest.param({"a": _on("n1", _slice([("L4", "22784Mi")] * 4))}, 4, id="one node"),
        pytest.param(
            {
                "a": _on("n1", _slice([("L4", "22784Mi")] * 4)),
                "b": _on("n2", _slice([("L4", "22784Mi")] * 8)),
            },
            8,
            id="the largest node",
        ),
        pytest.param(
            {
                "a": _on("n1", _slice([("L4", "22784Mi")] * 4)),
                "b": _on("n1", _slice([("L4", "22784Mi")] * 3)),
            },
            7,
            id="a node's slices add up",
        ),
        pytest.param(
            {"a": _on("n1", _slice([("L4", "22784Mi")] * 4, driver="gpu.nvidia.com"))},
            None,
            id="another driver's cards are not ours",
        ),
    ],
)
def test_the_most_cards_a_node_has_come_from_the_slices(
    slices: dict[str, dict[str, Any]], most: int | None
) -> None:
    known = SliceModels()
    for name, spec in slices.items():
        known.set_slice(name, spec)
    assert known.most_cards_on_a_node() == most


def test_a_deleted_slice_takes_its_models_along() -> None:
    known = SliceModels()
    known.set_slice("a", _slice([("L4", "22784Mi")]))
    known.remove_slice("a")
    assert known.models() == {}
    assert known.most_cards_on_a_node() is None


async def test_templates_named_by_pods_and_workloads_are_referenced(team_api: Api) -> None:
    claims = [{"name": "gpu-0", "resourceClaimTemplateName": "fracgpu-cards-1"}]
    pod_spec = {"containers": [{"name": "c", "image": "x"}], "resourceClaims": claims}
    await call_json(
        team_api,
        "POST",
        "/apis/apps/v1/namespaces/team-a/deployments",
        body={
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "scaled-to-zero"},
            "spec": {"replicas": 0, "template": {"spec": pod_spec}},
        },
    )
    assert await referenced_templates(team_api, "team-a") == {"fracgpu-cards-1"}


async def test_a_template_that_cannot_be_created_is_a_template_error(team_api: Api) -> None:
    store = TemplateStore(team_api, clock=Clock())
    with pytest.raises(TemplateError, match="could not create the ResourceClaimTemplate"):
        await store.ensure(
            "no-such-namespace",
            plan_claim("c", ContainerAsk(core=100), {}, max_cards=16),
            dry_run=False,
        )
