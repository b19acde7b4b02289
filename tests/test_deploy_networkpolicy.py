"""deploy/overlays/network-policy: the default overlay plus a NetworkPolicy that admits only the
API servers' addresses (and the other webhook replicas) to the webhook's port and only the
fracgpu-scheduler's pods to the scheduler extender's port, and nothing else changed."""

from __future__ import annotations

import ipaddress
from typing import Any

import kubernetes_validate
import pytest

from tests.deploy_render import find, of_kind, render

OVERLAY = "network-policy"


def policy() -> dict[str, Any]:
    (only,) = of_kind(render(OVERLAY), "NetworkPolicy")
    return only


def webhook_pod_labels() -> dict[str, str]:
    labels: dict[str, str] = find(render(OVERLAY), "Deployment", "fracgpu-webhook")["spec"][
        "template"
    ]["metadata"]["labels"]
    return labels


@pytest.mark.parametrize("version", ["1.30.0", "1.36.0"])
def test_the_policy_validates(version: str) -> None:
    kubernetes_validate.validate(policy(), version, strict=True)


def test_it_selects_the_webhook_pods() -> None:
    selector = policy()["spec"]["podSelector"]["matchLabels"]
    assert selector.items() <= webhook_pod_labels().items()


def test_it_restricts_ingress_only() -> None:
    assert policy()["spec"]["policyTypes"] == ["Ingress"]


def test_only_the_api_servers_and_the_other_replicas_may_reach_only_the_https_port() -> None:
    """The API servers by address; the webhook's own pods because replicas send quota
    decisions to the one that leads the quota controller. Nobody else, no other port."""
    api_servers, peers, _ = policy()["spec"]["ingress"]
    container = find(render(OVERLAY), "Deployment", "fracgpu-webhook")["spec"]["template"]["spec"][
        "containers"
    ][0]
    https = next(p["containerPort"] for p in container["ports"] if p["name"] == "https")
    for rule in (api_servers, peers):
        assert rule["ports"] == [{"protocol": "TCP", "port": https}]
    assert [sorted(peer) for peer in api_servers["from"]] == [["ipBlock"]] * len(
        api_servers["from"]
    )
    (replicas,) = peers["from"]
    assert sorted(replicas) == ["podSelector"]  # same namespace only: no namespaceSelector
    assert replicas["podSelector"]["matchLabels"].items() <= webhook_pod_labels().items()


def test_only_the_scheduler_may_reach_the_extender_port() -> None:
    """The fracgpu-scheduler calls the extender (placement by the extender is the default):
    its pods, in the same namespace, reach that port and no other."""
    objs = render(OVERLAY)
    rules = policy()["spec"]["ingress"]
    (container,) = find(objs, "Deployment", "fracgpu-webhook")["spec"]["template"]["spec"][
        "containers"
    ]
    extender = next(p["containerPort"] for p in container["ports"] if p["name"] == "extender")
    (rule,) = [r for r in rules if {"protocol": "TCP", "port": extender} in r["ports"]]
    assert rule["ports"] == [{"protocol": "TCP", "port": extender}]
    (caller,) = rule["from"]
    assert sorted(caller) == ["podSelector"]  # same namespace only: no namespaceSelector
    scheduler = find(objs, "Deployment", "fracgpu-scheduler")["spec"]["template"]["metadata"]
    assert caller["podSelector"]["matchLabels"].items() <= scheduler["labels"].items()
    assert not caller["podSelector"]["matchLabels"].items() <= webhook_pod_labels().items()


def test_the_shipped_range_matches_no_real_address() -> None:
    """Until an operator sets the API servers' range the policy must fail closed, never open:
    the placeholder is a documentation-only range (RFC 5737)."""
    rule = policy()["spec"]["ingress"][0]
    (peer,) = rule["from"]
    network = ipaddress.ip_network(peer["ipBlock"]["cidr"])
    assert network.subnet_of(ipaddress.ip_network("192.0.2.0/24"))


def test_everything_else_is_the_default_overlay() -> None:
    others = [o for o in render(OVERLAY) if o["kind"] != "NetworkPolicy"]
    assert others == render("default")
