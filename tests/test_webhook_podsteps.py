"""The steps Mutator runs on a pod, each on its own: walking the containers (webhook/podwalk.py),
normalising them remembered (webhook/normaliser.py), the models the pod chose
(webhook/podmodels.py), each share's policy (webhook/sharepolicy.py), DRA mode's claims
(webhook/podclaims.py) and the patch operations both modes share (webhook/podpatch.py). Whole
pods through the mutator are tests/test_webhook_mutation*.py's."""

from __future__ import annotations

from typing import Any

import pytest

from core.labels import MODEL_ANNOTATION, PRODUCT_LABEL, ModelSet
from core.policy import HARD_CAP, POLICY_ANNOTATION, PRIORITY_ANNOTATION, Priority, SharePolicy
from core.units import REQUEST_ANNOTATION, Grant
from webhook.claims import ClaimPlan, plan_claim
from webhook.config import AdmissionConfig
from webhook.dialects import enabled
from webhook.gpumodels import CardChoice, GpuModel
from webhook.normaliser import ContainerNormaliser
from webhook.parsing import ContainerAsk
from webhook.podclaims import claim_ops, claimed_env, plan_claims
from webhook.podmodels import PodModelReader, PodModels, affinity_op, model_expressions
from webhook.podpatch import PodPatcher, PodTarget, _tolerated, annotation_ops, escape, pointer
from webhook.podwalk import Located, containers, resource_keys
from webhook.resources import ContainerResult
from webhook.sharepolicy import policy_of, share_policies

L4 = GpuModel("NVIDIA-L4", 23034)
H100 = GpuModel("NVIDIA-H100-80GB-HBM3", 81559)
KNOWN = {L4.product: L4, H100.product: H100}
INPUTS = frozenset({"fracgpu.io/gpu", "fracgpu.io/gpumem", "fracgpu.io/core", "fracgpu.io/memory"})


def gpu(name: str, limits: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"name": name, "resources": {"limits": limits}, **extra}


# --- webhook/podwalk.py ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "found"),
    [
        pytest.param({}, [], id="no-lists"),
        pytest.param({"containers": "x"}, [], id="a-list-that-is-none"),
        pytest.param(
            {"containers": [{"name": "a"}, None, {"name": "b"}]},
            [("containers", 0, "a"), ("containers", 2, "b")],
            id="malformed-entries-skipped-indices-kept",
        ),
        pytest.param(
            {"containers": [{"name": "a"}], "initContainers": [{"name": "i"}]},
            [("initContainers", 0, "i"), ("containers", 0, "a")],
            id="init-containers-first",
        ),
        pytest.param(
            {"ephemeralContainers": [{"name": "debug"}]}, [], id="ephemeral-not-by-default"
        ),
    ],
)
def test_containers(spec: dict[str, Any], found: list[tuple[str, int, str]]) -> None:
    assert [(ln, ix, c["name"]) for ln, ix, c in containers(spec)] == found


@pytest.mark.parametrize(
    ("section", "keys"),
    [
        pytest.param({"a": 1, "b": 2}, ["a", "b"], id="a-map"),
        pytest.param(None, [], id="none"),
        pytest.param(["a"], [], id="not-a-map"),
    ],
)
def test_resource_keys(section: object, keys: list[str]) -> None:
    assert resource_keys(section) == keys


# --- webhook/normaliser.py -------------------------------------------------------------------


def normaliser() -> ContainerNormaliser:
    return ContainerNormaliser(AdmissionConfig(), enabled([]), sized=True)


@pytest.mark.parametrize(
    ("resources", "remembered"),
    [
        pytest.param({"limits": {"fracgpu.io/gpu": "0.5"}}, True, id="text-values"),
        pytest.param(None, True, id="no-resources"),
        pytest.param({"limits": {"fracgpu.io/gpu": 0.5}}, False, id="a-number-is-not"),
        pytest.param({"limits": ["x"]}, False, id="malformed-is-not"),
    ],
)
def test_normaliser_remembers_only_what_it_may(resources: Any, remembered: bool) -> None:
    n, choice = normaliser(), CardChoice((H100,))
    first, again = n("c", resources, choice), n("c", resources, choice)
    assert first == again
    assert (first is again) is remembered


def test_normaliser_never_reuses_a_result_for_another_choice() -> None:
    n = normaliser()
    resources = {"limits": {"fracgpu.io/gpu": "0.5"}}
    small = n("c", resources, CardChoice((L4,)))
    large = n("c", resources, CardChoice((H100,)))
    assert small.grant != large.grant


def test_normaliser_walks_a_pod_and_says_each_warning_once() -> None:
    spec = {
        "containers": [
            gpu("a", {"fracgpu.io/gpu": "0.5"}),
            gpu("b", {"fracgpu.io/gpu": "0.5"}),
            gpu("c", {"fracgpu.io/gpu": "x"}),
        ]
    }
    errors: list[str] = []
    warnings: list[str] = []
    results = normaliser().pod(spec, CardChoice((L4, H100)), errors, warnings)
    assert [(ln, ix, r.name) for ln, ix, _, r in results] == [
        ("containers", 0, "a"),
        ("containers", 1, "b"),
        ("containers", 2, "c"),
    ]
    assert len(errors) == 1 and errors[0].startswith('container "c"')
    assert len(warnings) == 2  # one per container named in it, none repeated


# --- webhook/podmodels.py --------------------------------------------------------------------


def reader() -> PodModelReader:
    return PodModelReader(lambda: KNOWN, INPUTS, hami=False)


@pytest.mark.parametrize(
    ("annotations", "spec", "chosen", "errors", "write"),
    [
        pytest.param({}, {}, None, 0, {}, id="no-choice"),
        pytest.param(
            {MODEL_ANNOTATION: "NVIDIA-L4"},
            {"containers": [gpu("c", {"fracgpu.io/gpu": "0.5"})]},
            ModelSet(frozenset({"NVIDIA-L4"})),
            0,
            {},
            id="a-known-model",
        ),
        pytest.param(
            {MODEL_ANNOTATION: "NVIDIA-L4"},
            {
                "containers": [gpu("c", {"fracgpu.io/gpu": "0.5"})],
                "nodeSelector": {PRODUCT_LABEL: "NVIDIA-H100-80GB-HBM3"},
            },
            ModelSet(frozenset({"NVIDIA-L4"})),
            1,
            {},
            id="contradicts-the-pin",
        ),
        pytest.param(
            {MODEL_ANNOTATION: "NoSuchGPU"},
            {"containers": [gpu("c", {"fracgpu.io/gpu": "0.5"})]},
            None,
            1,
            {},
            id="unknown-while-sizing",
        ),
    ],
)
def test_pod_model_reader(
    annotations: dict[str, str],
    spec: dict[str, Any],
    chosen: ModelSet | None,
    errors: int,
    write: dict[str, str],
) -> None:
    got = reader().read(spec, {"annotations": annotations})
    assert (got.chosen, len(got.errors), dict(got.write)) == (chosen, errors, write)


@pytest.mark.parametrize(
    ("chosen", "expressions"),
    [
        pytest.param(
            ModelSet(frozenset({"NVIDIA L4"})),
            [{"key": PRODUCT_LABEL, "operator": "In", "values": ["NVIDIA-L4"]}],
            id="only-label-safe",
        ),
        pytest.param(
            ModelSet(None, frozenset({"B", "A"})),
            [{"key": PRODUCT_LABEL, "operator": "NotIn", "values": ["A", "B"]}],
            id="excluded-sorted",
        ),
    ],
)
def test_model_expressions(chosen: ModelSet, expressions: list[dict[str, Any]]) -> None:
    assert model_expressions(chosen) == expressions


IN_L4 = {"key": PRODUCT_LABEL, "operator": "In", "values": ["NVIDIA-L4"]}
OTHER = {"key": "zone", "operator": "In", "values": ["a"]}


def _required(*terms: dict[str, Any]) -> dict[str, Any]:
    selector = {"nodeSelectorTerms": list(terms)}
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": selector}}


@pytest.mark.parametrize(
    ("affinity", "value"),
    [
        pytest.param(None, _required({"matchExpressions": [IN_L4]}), id="none-yet"),
        pytest.param(
            _required({"matchExpressions": [OTHER]}, {"matchExpressions": []}),
            _required({"matchExpressions": [OTHER, IN_L4]}, {"matchExpressions": [IN_L4]}),
            id="every-term-gets-it",
        ),
        pytest.param(_required({"matchExpressions": [IN_L4]}), None, id="already-there"),
    ],
)
def test_affinity_op(affinity: dict[str, Any] | None, value: dict[str, Any] | None) -> None:
    spec = {} if affinity is None else {"affinity": affinity}
    ops: list[dict[str, Any]] = []
    affinity_op(ops, "/x", spec, [IN_L4])
    expected = [] if value is None else [{"op": "add", "path": "/x/spec/affinity", "value": value}]
    assert ops == expected


# --- webhook/sharepolicy.py ------------------------------------------------------------------


def located(name: str, ask: ContainerAsk | None) -> Located:
    return ("containers", 0, {"name": name}, ContainerResult(name, ask=ask))


@pytest.mark.parametrize(
    ("priority", "ask", "policy", "errors", "warnings"),
    [
        pytest.param(None, ContainerAsk(30), HARD_CAP, 0, 0, id="hard-cap"),
        pytest.param(
            None, ContainerAsk(30, ceiling=60), SharePolicy(60), 0, 0, id="burst-low-by-default"
        ),
        pytest.param(
            "high",
            ContainerAsk(30, ceiling=60),
            SharePolicy(60, Priority.HIGH),
            0,
            0,
            id="the-pods-priority",
        ),
        pytest.param("high", ContainerAsk(30), HARD_CAP, 0, 1, id="priority-without-burst"),
        pytest.param("urgent", ContainerAsk(30), HARD_CAP, 1, 0, id="no-such-priority"),
        pytest.param(
            "high", ContainerAsk(30, exact=True), HARD_CAP, 0, 0, id="canonical-says-nothing"
        ),
    ],
)
def test_share_policies(
    priority: str | None, ask: ContainerAsk, policy: SharePolicy, errors: int, warnings: int
) -> None:
    meta = {} if priority is None else {"annotations": {PRIORITY_ANNOTATION: priority}}
    said_errors: list[str] = []
    said_warnings: list[str] = []
    policies = share_policies(meta, [located("c", ask)], said_errors, said_warnings)
    assert policies == {("containers", 0): policy}
    assert (len(said_errors), len(said_warnings)) == (errors, warnings)


def test_a_containers_own_priority_wins() -> None:
    result = ContainerResult("c", ask=ContainerAsk(30, ceiling=100, priority=Priority.HIGH))
    assert policy_of(result, Priority.LOW) == SharePolicy(100, Priority.HIGH)


# --- webhook/podclaims.py --------------------------------------------------------------------

TEMPLATE = plan_claim("c", ContainerAsk(core=100), {}, max_cards=16)


@pytest.mark.parametrize(
    ("spec", "found"),
    [
        pytest.param({}, {}, id="nothing"),
        pytest.param(
            {
                "resourceClaims": [{"name": "gpu-0", "resourceClaimTemplateName": TEMPLATE.name}],
                "containers": [{"resources": {"claims": [{"name": "gpu-0"}]}}],
            },
            {("containers", 0): {}},
            id="our-template",
        ),
        pytest.param(
            {
                "resourceClaims": [{"name": "mine", "resourceClaimTemplateName": "users"}],
                "containers": [{"resources": {"claims": [{"name": "mine"}]}}],
            },
            {},
            id="someone-elses-template",
        ),
    ],
)
def test_claimed_env(spec: dict[str, Any], found: dict[tuple[str, int], dict[str, str]]) -> None:
    assert claimed_env(spec) == found


def _plans() -> dict[tuple[str, int], ClaimPlan]:
    return {("containers", 0): TEMPLATE}


@pytest.mark.parametrize(
    ("present", "ops"),
    [
        pytest.param(
            None,
            [
                {
                    "op": "add",
                    "path": "/spec/resourceClaims",
                    "value": [{"name": "gpu-0", "resourceClaimTemplateName": TEMPLATE.name}],
                }
            ],
            id="no-list-yet",
        ),
        pytest.param(
            [{"name": "other"}],
            [
                {
                    "op": "add",
                    "path": "/spec/resourceClaims/-",
                    "value": {"name": "gpu-0", "resourceClaimTemplateName": TEMPLATE.name},
                }
            ],
            id="appended",
        ),
        pytest.param([{"name": "gpu-0"}], [], id="already-there"),
    ],
)
def test_claim_ops(present: list[dict[str, Any]] | None, ops: list[dict[str, Any]]) -> None:
    spec = {} if present is None else {"resourceClaims": present}
    got: list[dict[str, Any]] = []
    claim_ops(got, "", spec, _plans())
    assert got == ops


@pytest.mark.parametrize(
    ("ask", "planned", "errors"),
    [
        pytest.param(None, 0, 0, id="no-gpu"),
        pytest.param(ContainerAsk(core=200), 1, 0, id="whole-cards"),
        pytest.param(ContainerAsk(memory_mib=10**6), 0, 1, id="no-model-holds-it"),
    ],
)
def test_plan_claims(ask: ContainerAsk | None, planned: int, errors: int) -> None:
    said: list[str] = []
    plans = plan_claims(
        [located("c", ask)],
        KNOWN,
        None,
        {("containers", 0): HARD_CAP},
        max_cards=16,
        errors=said,
        warnings=[],
    )
    assert (len(plans), len(said)) == (planned, errors)


# --- webhook/podpatch.py ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tokens", "path"),
    [
        pytest.param(("spec", "template"), "/spec/template", id="plain"),
        pytest.param(("metadata", "fracgpu.io/request"), "/metadata/fracgpu.io~1request", id="/"),
        pytest.param(("a~b", 3), "/a~0b/3", id="tilde-and-index"),
    ],
)
def test_pointer(tokens: tuple[str | int, ...], path: str) -> None:
    assert pointer(*tokens) == path


def test_escape_leaves_plain_tokens_alone() -> None:
    assert escape("containers") == "containers"


WANTED = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


@pytest.mark.parametrize(
    ("present", "tolerated"),
    [
        pytest.param([], False, id="none"),
        pytest.param([{"operator": "Exists"}], True, id="tolerates-everything"),
        pytest.param([dict(WANTED)], True, id="the-same"),
        pytest.param([{"key": "nvidia.com/gpu", "operator": "Exists"}], True, id="any-effect"),
        pytest.param(
            [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoExecute"}],
            False,
            id="another-effect",
        ),
        pytest.param(["x"], False, id="malformed"),
    ],
)
def test_tolerated(present: list[Any], tolerated: bool) -> None:
    assert _tolerated(WANTED, present) is tolerated


class _Scheduler:
    def __init__(self, why: str | None) -> None:
        self.why = why

    def not_running(self) -> str | None:
        return self.why


@pytest.mark.parametrize(
    ("config", "current", "why", "op", "warned"),
    [
        pytest.param({}, None, None, None, False, id="none-configured"),
        pytest.param({"scheduler_name": "s"}, None, None, "add", False, id="added"),
        pytest.param(
            {"scheduler_name": "s"}, "default-scheduler", None, "replace", False, id="replaced"
        ),
        pytest.param({"scheduler_name": "s"}, "own", None, None, False, id="the-pods-own-kept"),
        pytest.param(
            {"scheduler_name": "s", "override_scheduler": True},
            "own",
            None,
            "replace",
            False,
            id="overridden",
        ),
        pytest.param({"scheduler_name": "s"}, None, "no lease", None, True, id="not-running"),
    ],
)
def test_scheduler_op(
    config: dict[str, Any], current: str | None, why: str | None, op: str | None, warned: bool
) -> None:
    patcher = PodPatcher(AdmissionConfig(**config), INPUTS, _Scheduler(why))
    spec = {} if current is None else {"schedulerName": current}
    ops: list[dict[str, Any]] = []
    warnings: list[str] = []
    patcher.scheduler_op(ops, warnings, spec)
    assert [o["op"] for o in ops] == ([] if op is None else [op])
    assert bool(warnings) is warned


@pytest.mark.parametrize(
    ("container", "claim", "ops"),
    [
        pytest.param(
            gpu("c", {"fracgpu.io/gpu": "0.5", "cpu": "1"}),
            None,
            [
                "replace /spec/containers/0/resources",
                "add /spec/containers/0/env",
            ],
            id="canonical-and-its-variables",
        ),
        pytest.param(
            gpu(
                "c",
                {"fracgpu.io/core": "50", "fracgpu.io/memory": "44"},
                env=[{"name": "FRACGPU_GPU", "value": "0.5"}],
            ),
            None,
            ["replace /spec/containers/0/resources", "add /spec/containers/0/env/-"],
            id="requests-and-the-missing-variable",
        ),
        pytest.param(
            gpu("c", {"fracgpu.io/gpu": "0.5"}),
            "gpu-0",
            ["replace /spec/containers/0/resources"],
            id="dra-claim-no-variables",
        ),
    ],
)
def test_container_ops(container: dict[str, Any], claim: str | None, ops: list[str]) -> None:
    patcher = PodPatcher(AdmissionConfig(), INPUTS)
    result = ContainerResult("c", grant=None if claim else Grant(50, 44))
    got: list[dict[str, Any]] = []
    claim_env = {} if claim else None
    patcher.container_ops(
        got, "/spec/containers/0", container, result, claim=claim, claim_env=claim_env
    )
    assert [f"{o['op']} {o['path']}" for o in got] == ops


def test_granted_env_adds_the_operators_extras() -> None:
    patcher = PodPatcher(AdmissionConfig(env={"EXTRA": "1"}), INPUTS)
    env = patcher.granted_env(Grant(50, 44))
    assert env["EXTRA"] == "1" and "FRACGPU_GPU" in env
    assert patcher.env_of(ContainerResult("c"), TEMPLATE) == {"EXTRA": "1"}


@pytest.mark.parametrize(
    ("meta", "policy", "ops"),
    [
        pytest.param(
            None,
            None,
            ["add /metadata", "add /metadata/annotations", "add /metadata/annotations/REQ"],
            id="no-metadata",
        ),
        pytest.param(
            {"annotations": {"fracgpu.io/compute-policy": "old"}},
            None,
            ["remove /metadata/annotations/POL", "add /metadata/annotations/REQ"],
            id="a-stale-policy-dropped",
        ),
        pytest.param(
            {"annotations": {}},
            "p",
            ["add /metadata/annotations/REQ", "add /metadata/annotations/POL"],
            id="policy-written-with-the-request",
        ),
    ],
)
def test_annotation_ops(meta: dict[str, Any] | None, policy: str | None, ops: list[str]) -> None:
    result = ContainerResult("c", grant=Grant(50, 44), request={"fracgpu.io/gpu": "0.5"})
    pod = PodTarget(
        "",
        {},
        meta or {},
        meta is not None,
        [("containers", 0, {}, result)],
        PodModels(),
        policy,
    )
    got: list[dict[str, Any]] = []
    annotation_ops(got, pod)
    shown = [
        f"{o['op']} {o['path']}".replace(escape(REQUEST_ANNOTATION), "REQ").replace(
            escape(POLICY_ANNOTATION), "POL"
        )
        for o in got
    ]
    assert shown == ops
