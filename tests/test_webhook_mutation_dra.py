"""Admission in DRA mode: GPU containers get claims from shared templates instead of extended
resources; the patch applies, reinvocation and pods made from mutated workloads are no-ops,
templates are made sure of before the reply (never on dry-run), and what cannot be sized is
denied with a reason."""

from __future__ import annotations

import copy
from typing import Any

import jsonpatch
import kubernetes_validate
import pytest

from core import dra
from core.admission import AdmissionRequest
from webhook.claims import ClaimPlan, TemplateError
from webhook.config import AdmissionConfig
from webhook.dialects import Dialect
from webhook.gpumodels import GpuModel
from webhook.inventory import Inventory
from webhook.mutation import Mutator

SLICE_MODELS = {"NVIDIA-L4": GpuModel("NVIDIA-L4", 23034)}


class Templates:
    """Records what the mutator asked to exist; fails when told to."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.ensured: list[tuple[str, str, bool]] = []

    async def ensure(self, namespace: str, plan: ClaimPlan, *, dry_run: bool) -> None:
        if self.fail:
            raise TemplateError(f"ResourceClaimTemplate {plan.name}: forbidden")
        self.ensured.append((namespace, plan.name, dry_run))


def mutator(
    models: dict[str, GpuModel] | None = None, templates: Templates | None = None
) -> Mutator:
    known = SLICE_MODELS if models is None else models
    return Mutator(
        AdmissionConfig(allocation="dra"),
        Inventory(),
        claim_models=lambda: known,
        templates=templates,
    )


def pod(limits: dict[str, Any], **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p", "namespace": "team-a"},
        "spec": {
            "containers": [{"name": "train", "image": "x", "resources": {"limits": limits}}],
            **spec,
        },
    }


def apply(m: Mutator, obj: dict[str, Any], group: str = "", kind: str = "Pod") -> dict[str, Any]:
    outcome = m.mutate(obj, group, kind)
    assert outcome.errors == []
    patched: dict[str, Any] = jsonpatch.apply_patch(obj, outcome.patch)
    again = m.mutate(patched, group, kind)
    assert again.errors == []
    assert again.patch == []
    return patched


def test_a_share_becomes_a_claim_from_a_shared_template() -> None:
    out = apply(mutator(), pod({"fracgpu.io/gpu": "300m", "fracgpu.io/gpumem": "8Gi", "cpu": "1"}))
    spec = out["spec"]
    container = spec["containers"][0]
    assert spec["resourceClaims"] == [
        {"name": "gpu-0", "resourceClaimTemplateName": "fracgpu-c30-m8192"}
    ]
    assert container["resources"] == {"limits": {"cpu": "1"}, "claims": [{"name": "gpu-0"}]}
    # The grant's variables come from the node (the claim's CDI spec), which knows the card.
    assert "env" not in container
    assert "fracgpu.io/request" in out["metadata"]["annotations"]


@pytest.mark.parametrize(
    ("limits", "template"),
    [
        pytest.param(
            {"fracgpu.io/gpu": "0.3", "fracgpu.io/gpumem": "8Gi", "fracgpu.io/gpu-count": "2"},
            "fracgpu-c30-m8192-n2",
            id="fracgpu.io/gpu-count",
        ),
        pytest.param(
            {"nvidia.com/gpu": "2", "nvidia.com/gpucores": "30", "nvidia.com/gpumem": "8192"},
            "fracgpu-c30-m8192-n2",
            id="HAMi's nvidia.com/gpu: 2 with a share",
        ),
    ],
)
def test_a_share_of_two_cards_becomes_one_request_for_two_cards(
    limits: dict[str, Any], template: str
) -> None:
    m = Mutator(
        AdmissionConfig(allocation="dra", dialects=(Dialect.HAMI,)),
        Inventory(),
        claim_models=lambda: SLICE_MODELS,
        templates=None,
    )
    out = apply(m, pod(limits))
    assert out["spec"]["resourceClaims"] == [
        {"name": "gpu-0", "resourceClaimTemplateName": template}
    ]


def test_the_device_class_extended_resource_becomes_whole_cards_in_a_claim() -> None:
    """Left alone, the scheduler would make this claim after admission, unseen by the quota."""
    out = apply(mutator(), pod({dra.DEVICE_CLASS_RESOURCE: "2", "cpu": "1"}))
    spec = out["spec"]
    assert spec["resourceClaims"] == [
        {"name": "gpu-0", "resourceClaimTemplateName": "fracgpu-cards-2"}
    ]
    assert spec["containers"][0]["resources"] == {
        "limits": {"cpu": "1"},
        "claims": [{"name": "gpu-0"}],
    }


def test_the_mutated_pod_is_a_valid_kubernetes_1_36_pod() -> None:
    out = apply(mutator(), pod({"fracgpu.io/gpu": "0.5"}))
    kubernetes_validate.validate(out, "1.36.0", strict=True)


@pytest.mark.parametrize(
    ("limits", "models", "template"),
    [
        pytest.param({"fracgpu.io/gpu": "1"}, {}, "fracgpu-cards-1", id="whole card, no model"),
        pytest.param({"fracgpu.io/gpu": "2"}, {}, "fracgpu-cards-2", id="two whole cards"),
        pytest.param(
            {"fracgpu.io/gpu": "0.5", "fracgpu.io/gpumem": "4Gi"},
            {},
            "fracgpu-c50-m4096",
            id="a share with memory needs no model",
        ),
    ],
)
def test_what_needs_no_model_is_admitted_with_none_known(
    limits: dict[str, str], models: dict[str, GpuModel], template: str
) -> None:
    out = apply(mutator(models), pod(limits))
    assert out["spec"]["resourceClaims"][0]["resourceClaimTemplateName"] == template


def test_a_fraction_alone_is_sized_per_published_model() -> None:
    outcome = mutator().mutate(pod({"fracgpu.io/gpu": "0.5"}), "", "Pod")
    [plan] = outcome.templates
    assert plan.name.startswith("fracgpu-c50-h")
    assert "firstAvailable" in plan.template["spec"]["spec"]["devices"]["requests"][0]


def test_what_cannot_be_sized_is_denied_with_the_reason() -> None:
    outcome = mutator({}).mutate(pod({"fracgpu.io/gpumem-percentage": "25"}), "", "Pod")
    assert outcome.errors == [
        'container "train": cannot size this request: no GPU models are published in the '
        "cluster's ResourceSlices yet; give both fracgpu.io/gpu and fracgpu.io/gpumem (for "
        "example 0.5 and 8Gi), or ask for whole cards"
    ]


def test_a_pod_made_from_a_mutated_deployment_passes_as_it_is() -> None:
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "d", "namespace": "team-a"},
        "spec": {"template": pod({"fracgpu.io/gpu": "0.25", "fracgpu.io/gpumem": "2Gi"})},
    }
    mutated = apply(mutator(), deployment, "apps", "Deployment")
    made = copy.deepcopy(mutated["spec"]["template"])
    outcome = mutator().mutate(made, "", "Pod")
    assert outcome.errors == []
    assert outcome.patch == []


def test_fracgpu_variables_in_a_claimed_container_are_the_users_and_denied() -> None:
    out = apply(mutator(), pod({"fracgpu.io/gpu": "1"}))
    out["spec"]["containers"][0]["env"] = [{"name": "FRACGPU_GPU", "value": "1"}]
    outcome = mutator().mutate(out, "", "Pod")
    assert len(outcome.errors) == 1
    assert "FRACGPU_GPU is set by fracgpu" in outcome.errors[0]


def _review(obj: dict[str, Any], *, dry_run: bool) -> AdmissionRequest:
    return AdmissionRequest.model_validate(
        {
            "uid": "u",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": "team-a",
            "operation": "CREATE",
            "object": obj,
            "dryRun": dry_run,
        }
    )


@pytest.mark.parametrize(
    "dry_run", [pytest.param(False, id="create"), pytest.param(True, id="dry")]
)
async def test_templates_are_made_sure_of_before_the_reply(dry_run: bool) -> None:
    templates = Templates()
    reply = await mutator(templates=templates)(
        _review(pod({"fracgpu.io/gpu": "1"}), dry_run=dry_run)
    )
    assert reply.allowed
    assert templates.ensured == [("team-a", "fracgpu-cards-1", dry_run)]


async def test_a_template_that_cannot_be_made_denies_the_pod() -> None:
    reply = await mutator(templates=Templates(fail=True))(
        _review(pod({"fracgpu.io/gpu": "1"}), dry_run=False)
    )
    assert not reply.allowed
    assert reply.status is not None
    assert reply.status.message == "ResourceClaimTemplate fracgpu-cards-1: forbidden"


# Choosing the GPU model in pod annotations (issue #28 item 4) ------------------------------

TWO_MODELS = {
    "NVIDIA-L4": GpuModel("NVIDIA-L4", 23034),
    "NVIDIA H100 80GB HBM3": GpuModel("NVIDIA H100 80GB HBM3", 81559),
}
PRODUCT = f'device.attributes["{dra.DRIVER}"].productName'


def chosen(annotations: dict[str, Any], limits: dict[str, Any]) -> dict[str, Any]:
    obj = pod(limits)
    obj["metadata"]["annotations"] = annotations
    return obj


def _gpu_request(outcome: Any) -> dict[str, Any]:
    [plan] = outcome.templates
    request: dict[str, Any] = plan.template["spec"]["spec"]["devices"]["requests"][0]
    return request


@pytest.mark.parametrize(
    ("annotations", "limits", "selector"),
    [
        pytest.param(
            {"fracgpu.io/gpu-model": "nvidia h100 80gb hbm3"},
            {"fracgpu.io/gpu": "1"},
            f'{PRODUCT} in ["NVIDIA H100 80GB HBM3"]',
            id="whole-card-in-the-slice-spelling",
        ),
        pytest.param(
            {"fracgpu.io/gpu-model-exclude": "NVIDIA-L4"},
            {"fracgpu.io/gpu": "0.5", "fracgpu.io/gpumem": "4Gi"},
            f'!({PRODUCT} in ["NVIDIA-L4"])',
            id="share-with-memory-excluded",
        ),
    ],
)
def test_model_choice_is_a_cel_selector_in_the_claim(
    annotations: dict[str, Any], limits: dict[str, Any], selector: str
) -> None:
    outcome = mutator(TWO_MODELS).mutate(chosen(annotations, limits), "", "Pod")
    assert _gpu_request(outcome)["exactly"]["selectors"] == [{"cel": {"expression": selector}}]


@pytest.mark.parametrize(
    "annotations",
    [
        pytest.param({"fracgpu.io/gpu-model": "NVIDIA-H100-80GB-HBM3"}, id="only"),
        pytest.param({"fracgpu.io/gpu-model-exclude": "NVIDIA-L4"}, id="exclude"),
    ],
)
def test_first_available_offers_only_the_chosen_models(annotations: dict[str, Any]) -> None:
    outcome = mutator(TWO_MODELS).mutate(chosen(annotations, {"fracgpu.io/gpu": "0.5"}), "", "Pod")
    offered = [
        alt["selectors"][0]["cel"]["expression"] for alt in _gpu_request(outcome)["firstAvailable"]
    ]
    assert offered == [dra.product_selector("NVIDIA H100 80GB HBM3")]


def test_model_choice_writes_no_node_affinity_in_dra_mode() -> None:
    obj = chosen({"fracgpu.io/gpu-model": "NVIDIA-L4"}, {"fracgpu.io/gpu": "1"})
    out = apply(mutator(TWO_MODELS), obj)
    assert "affinity" not in out["spec"]


def test_the_mutated_pod_with_a_model_choice_is_a_valid_kubernetes_1_36_pod() -> None:
    obj = chosen({"fracgpu.io/gpu-model": "NVIDIA-L4"}, {"fracgpu.io/gpu": "0.5"})
    kubernetes_validate.validate(apply(mutator(TWO_MODELS), obj), "1.36.0", strict=True)


@pytest.mark.parametrize(
    ("annotations", "expected"),
    [
        pytest.param(
            {"fracgpu.io/gpu-model": "H1000"},
            "fracgpu.io/gpu-model 'H1000' matches no GPU model in this cluster",
            id="unknown-model",
        ),
        pytest.param(
            {"fracgpu.io/gpu-model-exclude": "NVIDIA-L4"},
            "no GPU model of this cluster is left (known: NVIDIA-L4)",
            id="excludes-the-only-model",
        ),
    ],
)
def test_model_choice_denials_in_dra_mode(annotations: dict[str, Any], expected: str) -> None:
    outcome = mutator().mutate(chosen(annotations, {"fracgpu.io/gpu": "1"}), "", "Pod")
    assert expected in outcome.message


def test_a_pod_with_a_model_choice_made_from_a_mutated_deployment_passes_as_it_is() -> None:
    template = chosen({"fracgpu.io/gpu-model": "NVIDIA-L4"}, {"fracgpu.io/gpu": "1"})
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "d", "namespace": "team-a"},
        "spec": {"template": template},
    }
    mutated = apply(mutator(TWO_MODELS), deployment, "apps", "Deployment")
    made = copy.deepcopy(mutated["spec"]["template"])
    outcome = mutator({}).mutate(made, "", "Pod")  # the L4 pool scaled to zero since
    assert (outcome.errors, outcome.patch) == ([], [])


def test_a_bursting_share_carries_its_policy_in_its_claim() -> None:
    """The claim asks the guarantee (what quota counts and the scheduler places); its opaque
    configuration says how far the share may burst and at which priority, for the node."""
    obj = pod({"fracgpu.io/gpu": "1", "fracgpu.io/gpumem": "8Gi"})
    obj["spec"]["containers"][0]["resources"]["requests"] = {"fracgpu.io/gpu": "0.3"}
    obj["metadata"]["annotations"] = {"fracgpu.io/gpu-priority": "high"}
    templates = Templates()
    m = mutator(templates=templates)
    out = apply(m, obj)
    name = "fracgpu-c30-m8192-x100-hi"
    assert out["spec"]["resourceClaims"] == [{"name": "gpu-0", "resourceClaimTemplateName": name}]
    (plan,) = m.mutate(obj, "", "Pod").templates
    devices = plan.template["spec"]["spec"]["devices"]
    assert devices["config"] == [
        {
            "requests": ["gpu"],
            "opaque": {
                "driver": "gpu.fracgpu.io",
                "parameters": {
                    "apiVersion": "gpu.fracgpu.io/v1",
                    "kind": "SharePolicy",
                    "ceiling": 100,
                    "priority": "high",
                },
            },
        }
    ]
    assert devices["requests"][0]["exactly"]["capacity"]["requests"]["cores"] == "30"
    assert "fracgpu.io/compute-policy" not in out["metadata"]["annotations"]
