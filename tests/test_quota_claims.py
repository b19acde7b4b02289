"""quota/claims.py: DRA claims of the fracgpu class, counted in cards and MiB like extended
resources, whoever wrote them; and a GPUQuota applied to pods that hold claims."""

from __future__ import annotations

from typing import Any

import pytest

from core import dra
from core.contract import MAX_DEVICES
from core.kube import RESOURCE_CLAIM_TEMPLATES, RESOURCE_CLAIMS, Api, call_json
from quota.claims import CLAIM, TEMPLATE, ClaimCharge, ClaimSpecs, charge_of, claim_refs
from quota.demand import Demand, pod_demand

L4_MIB = 23034  # 89 blocks


def _exact(**fields: Any) -> dict[str, Any]:
    return {"exactly": {"deviceClassName": dra.DEVICE_CLASS, **fields}}


def _share(cores: str, memory: str, count: int = 1) -> dict[str, Any]:
    return _exact(count=count, capacity={"requests": {"cores": cores, "memory": memory}})


def _spec(*requests: dict[str, Any]) -> dict[str, Any]:
    return {"devices": {"requests": [{"name": f"r{i}", **r} for i, r in enumerate(requests)]}}


@pytest.mark.parametrize(
    ("specs", "most_cards", "charge"),
    [
        pytest.param(
            [_spec(_exact(allocationMode="All"))],
            4,
            ClaimCharge(400, 4 * 89),
            id="every card of the largest node",
        ),
        pytest.param(
            [_spec(_exact(allocationMode="All"))],
            None,
            ClaimCharge(100 * MAX_DEVICES, MAX_DEVICES * 89),
            id="no node known: the most one container can get",
        ),
        pytest.param(
            [_spec(_exact(allocationMode="All", capacity={"requests": {"cores": "10"}}))],
            8,
            ClaimCharge(80, 8 * 89),
            id="a share of every card",
        ),
        pytest.param(
            [_spec(_exact(allocationMode="ExactCount", count=2))],
            8,
            ClaimCharge(200, 178),
            id="exact count is its count",
        ),
    ],
)
def test_allocation_mode_all_takes_every_card_a_node_has(
    specs: list[dict[str, Any]], most_cards: int | None, charge: ClaimCharge
) -> None:
    assert charge_of(specs, L4_MIB, most_cards) == charge


@pytest.mark.parametrize(
    ("specs", "card_mib", "charge"),
    [
        pytest.param([_spec(_share("30", "8Gi"))], None, ClaimCharge(30, 32), id="a share"),
        pytest.param(
            [_spec(_share("50", "300Mi", count=2))], None, ClaimCharge(100, 4), id="two shares"
        ),
        pytest.param(
            [_spec(_exact(count=2))], L4_MIB, ClaimCharge(200, 178), id="whole cards, card known"
        ),
        pytest.param(
            [_spec(_exact())], None, ClaimCharge(100, 0, 1), id="a whole card, no card known"
        ),
        pytest.param(
            [
                _spec(
                    {
                        "firstAvailable": [
                            {**_share("25", "5Gi")["exactly"], "name": "a"},
                            {**_share("20", "20Gi")["exactly"], "name": "b"},
                        ]
                    }
                )
            ],
            None,
            ClaimCharge(25, 80),
            id="first available charges the largest alternative",
        ),
        pytest.param(
            [_spec({"exactly": {"deviceClassName": "gpu.nvidia.com", "count": 4}})],
            None,
            ClaimCharge(),
            id="another class is not ours",
        ),
        pytest.param(
            [_spec(_share("30", "8Gi")), _spec(_share("20", "1Gi"))],
            None,
            ClaimCharge(50, 36),
            id="several claims add up",
        ),
    ],
)
def test_what_claims_charge(
    specs: list[dict[str, Any]], card_mib: int | None, charge: ClaimCharge
) -> None:
    assert charge_of(specs, card_mib) == charge


def _pod(claims: list[dict[str, Any]], used: list[str]) -> dict[str, Any]:
    return {
        "metadata": {"name": "p", "namespace": "team-a", "uid": "u"},
        "spec": {
            "resourceClaims": claims,
            "containers": [
                {"name": "a", "image": "x", "resources": {"claims": [{"name": n} for n in used]}},
                {"name": "b", "image": "x", "resources": {"claims": [{"name": n} for n in used]}},
            ],
        },
    }


def test_a_claim_shared_by_containers_counts_once_and_unused_ones_not_at_all() -> None:
    pod = _pod(
        [
            {"name": "gpu", "resourceClaimTemplateName": "fracgpu-c30-m8192"},
            {"name": "mine", "resourceClaimName": "hand-written"},
            {"name": "unused", "resourceClaimName": "other"},
        ],
        ["gpu", "mine"],
    )
    assert claim_refs(pod) == [
        ("team-a", TEMPLATE, "fracgpu-c30-m8192"),
        ("team-a", CLAIM, "hand-written"),
    ]


async def test_pods_holding_claims_are_charged_what_the_claims_request(team_api: Api) -> None:
    await call_json(
        team_api,
        "POST",
        RESOURCE_CLAIM_TEMPLATES.path("team-a"),
        body={
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaimTemplate",
            "metadata": {"name": "fracgpu-c30-m8192"},
            "spec": {"spec": _spec(_share("30", "8192Mi"))},
        },
    )
    await call_json(
        team_api,
        "POST",
        RESOURCE_CLAIMS.path("team-a"),
        body={
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": "hand-written"},
            "spec": _spec(_exact()),
        },
    )
    pod = _pod(
        [
            {"name": "gpu", "resourceClaimTemplateName": "fracgpu-c30-m8192"},
            {"name": "mine", "resourceClaimName": "hand-written"},
        ],
        ["gpu", "mine"],
    )
    specs = ClaimSpecs(team_api)
    await specs.load(claim_refs(pod))
    assert pod_demand(pod, lambda _: L4_MIB, specs) == Demand(130, (32 + 89) * 256)


async def test_a_claim_that_does_not_exist_is_reported_missing(team_api: Api) -> None:
    pod = _pod([{"name": "mine", "resourceClaimName": "not-yet"}], ["mine"])
    specs = ClaimSpecs(team_api)
    await specs.load(claim_refs(pod))
    demand = pod_demand(pod, None, specs)
    assert demand is not None
    assert demand.missing_claims == ("claim not-yet",)
