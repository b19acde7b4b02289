"""Pod and workload mutation: the patch applies to what the apiserver sent and is idempotent."""

from __future__ import annotations

import copy
import json
from typing import Any

import jsonpatch
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.admission import AdmissionRequest
from webhook.config import AdmissionConfig
from webhook.dialects import Dialect
from webhook.inventory import Inventory
from webhook.mutation import TEMPLATE_PATHS, Mutator

INVENTORY = {"NVIDIA-H100-80GB-HBM3": 81559}


def mutator(**config: Any) -> Mutator:
    return Mutator(AdmissionConfig(**config), Inventory(INVENTORY))


def pod(*containers: dict[str, Any], **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"generateName": "rs-abc-", "labels": {"app": "x"}},
        "spec": {"containers": list(containers), **spec},
    }


def container(name: str = "main", limits: dict[str, Any] | None = None, **extra: Any) -> Any:
    c: dict[str, Any] = {"name": name, "image": "python:3.11"}
    if limits is not None:
        c["resources"] = {"limits": limits}
    c.update(extra)
    return c


def apply(m: Mutator, obj: dict[str, Any], group: str = "", kind: str = "Pod") -> dict[str, Any]:
    outcome = m.mutate(obj, group, kind)
    assert outcome.allowed, outcome.errors
    patched: dict[str, Any] = jsonpatch.apply_patch(obj, outcome.patch)
    # Reinvocation on our own output changes nothing and warns nothing.
    again = m.mutate(patched, group, kind)
    assert again.allowed, again.patch
    assert again.patch == [], again.patch
    return patched


def test_fraction_is_rewritten_with_everything_design_3_adds() -> None:
    obj = pod(container("train", {"fracgpu.io/gpu": "300m", "cpu": "2"}))
    out = apply(mutator(), obj)
    c = out["spec"]["containers"][0]
    assert c["resources"] == {
        "limits": {"cpu": "2", "fracgpu.io/core": "30", "fracgpu.io/memory": "95"},
        "requests": {"fracgpu.io/core": "30", "fracgpu.io/memory": "95"},
    }
    assert c["env"] == [
        {"name": "FRACGPU_GPU", "value": "0.3"},
        {"name": "FRACGPU_MEMORY_MIB", "value": "24320"},
    ]
    assert "schedulerName" not in out["spec"]  # left to the pod (admission.scheduler_name)
    assert out["spec"]["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    ]
    assert json.loads(out["metadata"]["annotations"]["fracgpu.io/request"]) == {
        "train": {"fracgpu.io/gpu": "0.3"}
    }
    assert out["metadata"]["labels"] == {"app": "x"}  # untouched


def test_no_gpu_pod_is_untouched() -> None:
    outcome = mutator().mutate(pod(container("web", {"cpu": "1"})), "", "Pod")
    assert outcome.allowed
    assert outcome.patch == []
    assert not outcome.gpu


def test_zero_gpu_is_stripped_without_gpu_additions() -> None:
    out = apply(mutator(), pod(container("web", {"fracgpu.io/gpu": "0", "cpu": "1"})))
    assert out["spec"]["containers"][0]["resources"] == {"limits": {"cpu": "1"}}
    assert "schedulerName" not in out["spec"]


def test_existing_env_tolerations_and_scheduler() -> None:
    obj = pod(
        container("a", {"fracgpu.io/gpu": "0.5"}, env=[{"name": "X", "value": "1"}]),
        tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists"}],
        schedulerName="my-scheduler",
    )
    out = apply(mutator(), obj)
    assert [e["name"] for e in out["spec"]["containers"][0]["env"]] == [
        "X",
        "FRACGPU_GPU",
        "FRACGPU_MEMORY_MIB",
    ]
    assert out["spec"]["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists"}]
    assert out["spec"]["schedulerName"] == "my-scheduler"


PROFILE = "fracgpu-scheduler"


@pytest.mark.parametrize(
    ("config", "named", "expected"),
    [
        pytest.param({}, None, None, id="default-leaves-it-unset"),
        pytest.param({}, "default-scheduler", "default-scheduler", id="default-leaves-default"),
        pytest.param({}, "my-scheduler", "my-scheduler", id="default-leaves-named"),
        pytest.param({"scheduler_name": PROFILE}, None, PROFILE, id="configured-sets-unset"),
        pytest.param(
            {"scheduler_name": PROFILE},
            "default-scheduler",
            PROFILE,
            id="configured-replaces-default",
        ),
        pytest.param(
            {"scheduler_name": PROFILE}, "my-scheduler", "my-scheduler", id="configured-keeps-named"
        ),
        pytest.param(
            {"scheduler_name": PROFILE, "override_scheduler": True},
            "my-scheduler",
            PROFILE,
            id="override-replaces-named",
        ),
    ],
)
def test_scheduler_name(config: dict[str, Any], named: str | None, expected: str | None) -> None:
    extra = {} if named is None else {"schedulerName": named}
    out = apply(mutator(**config), pod(container("a", {"fracgpu.io/gpu": "1"}), **extra))
    assert out["spec"].get("schedulerName") == expected


def test_init_containers_and_sidecars_and_multi_container() -> None:
    obj = pod(
        container("app", {"fracgpu.io/gpu": "0.2"}),
        container("plain"),
        initContainers=[
            container("warmup", {"fracgpu.io/gpu": "0.5", "fracgpu.io/gpumem": "4Gi"}),
            container("proxy", {"fracgpu.io/gpu": "0.1"}, restartPolicy="Always"),
        ],
    )
    out = apply(mutator(), obj)
    inits = out["spec"]["initContainers"]
    assert inits[0]["resources"]["limits"] == {"fracgpu.io/core": "50", "fracgpu.io/memory": "16"}
    assert inits[1]["resources"]["limits"]["fracgpu.io/core"] == "10"
    assert "env" not in out["spec"]["containers"][1]
    recorded = json.loads(out["metadata"]["annotations"]["fracgpu.io/request"])
    assert set(recorded) == {"app", "warmup", "proxy"}


def test_denial_names_every_problem() -> None:
    obj = pod(
        container("a", {"fracgpu.io/gpu": "1.5"}),
        container("b", {"fracgpu.io/gpu": "0.5", "fracgpu.io/gpumem-percentage": "120"}),
    )
    outcome = mutator().mutate(obj, "", "Pod")
    assert not outcome.allowed
    assert outcome.patch == []
    assert outcome.message == (
        'container "a": fracgpu.io/gpu must be a fraction between 0.01 and 1 with at most two '
        "decimals, or a whole number of cards; got 1.5; "
        'container "b": fracgpu.io/gpumem-percentage must be a whole percentage between 1 and 100; '
        "got 120"
    )


@pytest.mark.parametrize(
    ("obj", "expected"),
    [
        pytest.param(
            pod(
                container(
                    "a", {"fracgpu.io/gpu": "0.5"}, env=[{"name": "FRACGPU_GPU", "value": "1"}]
                )
            ),
            'container "a": environment variable FRACGPU_GPU is set by fracgpu and cannot be '
            'set in the pod spec (got "1"); remove it',
            id="fracgpu variable that differs from the grant",
        ),
        pytest.param(
            pod(
                container(
                    "a", {"fracgpu.io/gpu": "0.5"}, env=[{"name": "FRACGPU_DISABLE", "value": "1"}]
                )
            ),
            "FRACGPU_DISABLE is set by fracgpu",
            id="a FRACGPU_ variable fracgpu never sets",
        ),
        pytest.param(
            pod(
                container(
                    "a", {"cpu": "1"}, env=[{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]
                )
            ),
            'container "a": environment variable NVIDIA_VISIBLE_DEVICES selects GPUs and is set '
            "only by the fracgpu device plugin; remove it and request fracgpu.io/gpu instead",
            id="NVIDIA_VISIBLE_DEVICES on a plain pod",
        ),
        pytest.param(
            pod(
                container("a", {"fracgpu.io/gpu": "0.5"}),
                container(
                    "b",
                    env=[{"name": "NVIDIA_VISIBLE_DEVICES", "valueFrom": {"fieldRef": {}}}],
                ),
            ),
            'container "b": environment variable NVIDIA_VISIBLE_DEVICES',
            id="NVIDIA_VISIBLE_DEVICES from a field",
        ),
        pytest.param(
            pod(
                container(
                    "a",
                    {"fracgpu.io/gpu": "0.5"},
                    volumeMounts=[{"name": "v", "mountPath": "/etc/ld.so.preload"}],
                )
            ),
            'container "a": volume mount at /etc/ld.so.preload covers a path the fracgpu device',
            id="a mount over ld.so.preload",
        ),
        pytest.param(
            pod(
                container(
                    "a",
                    {"fracgpu.io/gpu": "0.5"},
                    volumeMounts=[{"name": "v", "mountPath": "/run/fracgpu/limits/../limits/"}],
                )
            ),
            "volume mount at /run/fracgpu/limits/../limits/ covers",
            id="a mount over the limits through dots",
        ),
        pytest.param(
            pod(
                container("a", {"fracgpu.io/gpu": "0.5"}),
                volumes=[{"name": "state", "hostPath": {"path": "/var/lib/fracgpu/containers"}}],
            ),
            'volume "state": hostPath /var/lib/fracgpu/containers holds fracgpu\'s node state',
            id="host state by path",
        ),
        pytest.param(
            pod(
                container("a", {"fracgpu.io/gpu": "0.5"}),
                volumes=[{"name": "s", "hostPath": {"path": "/proc/1/root/var/lib/fracgpu"}}],
            ),
            'volume "s": hostPath /proc/1/root/var/lib/fracgpu (the node\'s /var/lib/fracgpu) '
            "holds fracgpu's node state",
            id="host-state-through-proc",
        ),
        pytest.param(
            pod(
                container("a", {"fracgpu.io/gpu": "1"}),
                volumes=[{"name": "k", "hostPath": {"path": "/var/lib/kubelet/device-plugins/"}}],
            ),
            'volume "k": hostPath /var/lib/kubelet/device-plugins/ (the node\'s '
            "/var/lib/kubelet/device-plugins) holds kubelet's device plugin sockets",
            id="kubelet-device-plugin-sockets",
        ),
        pytest.param(
            pod(container("a", {"cpu": "1"}))
            | {"metadata": {"annotations": {"cdi.k8s.io/g": "x"}}},
            "annotation cdi.k8s.io/g asks the container runtime for devices",
            id="cdi-annotation-on-a-plain-pod",
        ),
    ],
)
def test_system_owned_settings_are_denied(obj: dict[str, Any], expected: str) -> None:
    outcome = mutator().mutate(obj, "", "Pod")
    assert not outcome.allowed
    assert expected in outcome.message


def test_privileged_gpu_containers_are_denied_unless_allowed() -> None:
    obj = pod(
        container("a", {"fracgpu.io/gpu": "0.5"}),
        container("debug", securityContext={"privileged": True}),
    )
    outcome = mutator().mutate(obj, "", "Pod")
    assert outcome.message == (
        'container "debug": is privileged; a privileged container sees every GPU of the node and '
        "escapes its share; remove securityContext.privileged from GPU pods"
    )
    assert mutator(allow_privileged=True).mutate(obj, "", "Pod").allowed
    no_gpu = pod(container("debug", securityContext={"privileged": True}))
    assert mutator().mutate(no_gpu, "", "Pod").allowed


def test_reserved_annotation_is_denied() -> None:
    obj = pod(container("a", {"fracgpu.io/gpu": "0.5"}))
    obj["metadata"]["annotations"] = {"fracgpu.io/unlimited": "true"}
    outcome = mutator().mutate(obj, "", "Pod")
    assert outcome.message == (
        "annotation fracgpu.io/unlimited is reserved for fracgpu and cannot be set on a GPU pod; "
        "remove it"
    )


def test_harmless_visible_devices_values_are_allowed() -> None:
    env = [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}]
    assert mutator().mutate(pod(container("a", env=env)), "", "Pod").allowed


def deployment(kind: str, group: str, limits: dict[str, Any]) -> dict[str, Any]:
    template = {
        "metadata": {"labels": {"app": "x"}},
        "spec": {"containers": [container("c", limits)]},
    }
    if kind == "CronJob":
        spec: dict[str, Any] = {
            "schedule": "* * * * *",
            "jobTemplate": {"spec": {"template": template}},
        }
    else:
        spec = {"selector": {"matchLabels": {"app": "x"}}, "template": template}
    return {
        "apiVersion": f"{group}/v1" if group else "v1",
        "kind": kind,
        "metadata": {"name": "w"},
        "spec": spec,
    }


@pytest.mark.parametrize(("group", "kind"), [k for k in TEMPLATE_PATHS if k[1] != "Pod"])
def test_workload_templates(group: str, kind: str) -> None:
    obj = deployment(kind, group, {"fracgpu.io/gpu": 0.5})
    out = apply(mutator(), obj, group, kind)
    template: Any = out
    for token in TEMPLATE_PATHS[(group, kind)]:
        template = template[token]
    limits = template["spec"]["containers"][0]["resources"]["limits"]
    assert limits == {"fracgpu.io/core": "50", "fracgpu.io/memory": "159"}
    assert "fracgpu.io/request" in template["metadata"]["annotations"]
    # A pod made from the mutated template is already canonical: the webhook leaves it alone.
    made = {"apiVersion": "v1", "kind": "Pod", **copy.deepcopy(template)}
    assert mutator().mutate(made, "", "Pod").patch == []


def test_template_without_metadata_gets_parents() -> None:
    obj = deployment("Deployment", "apps", {"fracgpu.io/gpu": "1"})
    del obj["spec"]["template"]["metadata"]
    out = apply(mutator(), obj, "apps", "Deployment")
    assert "fracgpu.io/request" in out["spec"]["template"]["metadata"]["annotations"]


def test_unknown_kinds_pass() -> None:
    assert mutator().mutate({"kind": "ConfigMap"}, "", "ConfigMap").patch == []


def test_hami_dialect_when_enabled() -> None:
    obj = pod(container("a", {"nvidia.com/gpu": "1", "nvidia.com/gpucores": "25"}))
    assert mutator().mutate(obj, "", "Pod").patch == []  # not ours unless enabled
    out = apply(mutator(dialects=[Dialect.HAMI]), obj)
    assert out["spec"]["containers"][0]["resources"]["limits"] == {
        "fracgpu.io/core": "25",
        "fracgpu.io/memory": "79",
    }


async def test_reviewer_answers_admission_requests() -> None:
    m = mutator()
    base = {"uid": "u1", "kind": {"group": "", "version": "v1", "kind": "Pod"}, "namespace": "ns"}
    req = AdmissionRequest.model_validate(
        {**base, "operation": "CREATE", "object": pod(container("a", {"fracgpu.io/gpu": "0.5"}))}
    )
    response = await m(req)
    assert response.allowed
    assert response.patch_type == "JSONPatch"
    assert response.decoded_patch()
    upd = AdmissionRequest.model_validate({**base, "operation": "UPDATE", "object": {}})
    assert (await m(upd)).patch is None
    delete = AdmissionRequest.model_validate({**base, "operation": "DELETE", "object": None})
    assert (await m(delete)).allowed


# Huge numbers and long text: Python will not print an integer of more than 4,300 digits.
_huge = st.integers(4301, 5000).map(lambda n: -(10**n) if n % 2 else 10**n) | st.sampled_from(
    ["9" * 5000, "1e30", "0." + "1" * 70]
)
pod_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=10) | _huge,
    lambda c: (
        st.lists(c, max_size=3)
        | st.dictionaries(
            st.sampled_from(
                [
                    "spec",
                    "containers",
                    "initContainers",
                    "resources",
                    "limits",
                    "requests",
                    "env",
                    "name",
                    "value",
                    "metadata",
                    "annotations",
                    "volumeMounts",
                    "mountPath",
                    "fracgpu.io/gpu",
                    "tolerations",
                    "volumes",
                    "hostPath",
                    "path",
                    "nodeSelector",
                    "affinity",
                    "ephemeralContainers",
                    "securityContext",
                    "privileged",
                    "cdi.k8s.io/x",
                    "fracgpu.io/core",
                    "schedulerName",
                ]
            ),
            c,
            max_size=4,
        )
    ),
    max_leaves=25,
)


@settings(max_examples=300, deadline=None)
@given(obj=pod_json)
def test_hostile_objects_never_raise_and_patches_apply(obj: Any) -> None:
    if not isinstance(obj, dict):
        obj = {"spec": obj}
    outcome = mutator().mutate(obj, "", "Pod")
    if outcome.allowed and outcome.patch:
        jsonpatch.apply_patch(obj, outcome.patch)


PRODUCT, MEMORY_MIB = "fracgpu.io/gpu.product", "fracgpu.io/gpu.memory-mib"
H100_LABELS = {PRODUCT: "NVIDIA-H100-80GB-HBM3", MEMORY_MIB: "81559"}
L4_LABELS = {PRODUCT: "NVIDIA-L4", MEMORY_MIB: "23034"}


def blocks(obj: dict[str, Any]) -> str:
    memory: str = obj["spec"]["containers"][0]["resources"]["limits"]["fracgpu.io/memory"]
    return memory


def test_remembered_containers_follow_the_inventory() -> None:
    inv = Inventory()
    m = Mutator(AdmissionConfig(), inv)
    obj = pod(container("nb", {"fracgpu.io/gpu": "0.5"}))
    assert m.mutate(obj, "", "Pod").errors  # nothing known yet: denied, and remembered so
    inv.set_node("n1", L4_LABELS)
    assert blocks(apply(m, obj)) == "44"
    inv.set_node("n1", H100_LABELS)  # the same node, relabelled: sized for the new card
    assert blocks(apply(m, obj)) == "159"


@pytest.mark.parametrize(
    ("first", "second"),
    [(True, 1), (1, True), ("1", 1.0), (1.0, "1"), ("1", True), (0.5, "0.5")],
    ids=[
        "bool then int",
        "int then bool",
        "text then float",
        "float then text",
        "text then bool",
        "float then its text",
    ],
)
def test_values_that_hash_alike_are_not_confused(first: Any, second: Any) -> None:
    m = mutator()
    fresh = mutator()
    for value in (first, second, first):
        obj = pod(container("c", {"fracgpu.io/gpu": value}))
        got, want = m.mutate(obj, "", "Pod"), fresh.mutate(obj, "", "Pod")
        assert (got.patch, got.errors, got.warnings) == (want.patch, want.errors, want.warnings)
        fresh = mutator()


def test_memo_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    import webhook.normaliser
    import webhook.podpatch

    monkeypatch.setattr(webhook.normaliser, "MEMO_SIZE", 8)
    monkeypatch.setattr(webhook.podpatch, "ENV_MEMO_SIZE", 8)
    m = mutator()
    for i in range(50):
        apply(m, pod(container(f"c{i}", {"fracgpu.io/gpu": "0.25"})))
        assert len(m.normaliser._memo) <= 8
        assert len(m.patcher._env) <= 8


# A small vocabulary, so that a long-lived mutator mostly answers from what it remembers.
_names = st.sampled_from(["a", "b"])
_limits = st.dictionaries(
    st.sampled_from(["fracgpu.io/gpu", "fracgpu.io/gpumem", "fracgpu.io/gpumem-percentage", "cpu"]),
    st.sampled_from(["1", "2", "25", "0.5", "8Gi", "0", "abc"]),
    max_size=3,
)
_requests = st.one_of(st.just("same"), st.just("none"), _limits)
_steps = st.lists(
    st.one_of(
        st.tuples(
            st.just("pod"),
            st.lists(st.tuples(_names, _limits, _requests), min_size=1, max_size=3),
        ),
        st.tuples(st.just("node"), st.sampled_from(["n1", "n2"]), st.sampled_from([0, 1, 2])),
    ),
    min_size=1,
    max_size=30,
)


@settings(max_examples=300, deadline=None)
@given(steps=_steps)
def test_long_lived_mutator_answers_as_a_fresh_one(steps: list[Any]) -> None:
    """What the mutator remembers (normalised containers, card choices) never changes a reply."""
    inv = Inventory({"Static-GPU": 16384})
    config = AdmissionConfig()
    kept = Mutator(config, inv)
    labels: list[dict[str, str]] = [{}, H100_LABELS, L4_LABELS]
    nodes: dict[str, dict[str, str]] = {}
    for step in steps:
        if step[0] == "node":
            nodes[step[1]] = labels[step[2]]
            inv.set_node(step[1], labels[step[2]])
            continue
        containers = []
        for name, limits, requests in step[1]:
            c = container(name, dict(limits))
            if requests != "none":
                c["resources"]["requests"] = dict(limits if requests == "same" else requests)
            containers.append(c)
        obj = pod(*containers)
        got = kept.mutate(obj, "", "Pod")
        fresh = Inventory({"Static-GPU": 16384})
        fresh.replace_nodes(nodes.items())
        want = Mutator(config, fresh).mutate(copy.deepcopy(obj), "", "Pod")
        assert (got.patch, got.errors, got.warnings, got.gpu) == (
            want.patch,
            want.errors,
            want.warnings,
            want.gpu,
        )


# Deployment → ReplicaSet → Pod --------------------------------------------------------------


def replicaset_from(deploy: dict[str, Any]) -> dict[str, Any]:
    """A ReplicaSet as the Deployment controller makes it: the template copied, a hash added."""
    template = copy.deepcopy(deploy["spec"]["template"])
    template.setdefault("metadata", {}).setdefault("labels", {})["pod-template-hash"] = "5d9f"
    return {
        "apiVersion": "apps/v1",
        "kind": "ReplicaSet",
        "metadata": {"name": "w-5d9f", "ownerReferences": [{"kind": "Deployment", "name": "w"}]},
        "spec": {"replicas": 1, "selector": deploy["spec"]["selector"], "template": template},
    }


def pod_from(owner: dict[str, Any]) -> dict[str, Any]:
    """A Pod as the ReplicaSet controller makes it from the template."""
    template = copy.deepcopy(owner["spec"]["template"])
    meta = {**template.get("metadata", {}), "generateName": "w-5d9f-"}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": template["spec"]}


def admitted(m: Mutator, obj: dict[str, Any], group: str, kind: str) -> dict[str, Any]:
    outcome = m.mutate(obj, group, kind)
    assert outcome.errors == [], kind
    patched: dict[str, Any] = jsonpatch.apply_patch(obj, outcome.patch)
    return patched


NODES = {"l4": L4_LABELS, "h100": H100_LABELS}


@pytest.mark.parametrize(
    ("limits", "before", "after"),
    [
        pytest.param(
            {"fracgpu.io/gpumem": "24576"}, ["l4", "h100"], ["l4", "h100"], id="memory-over-l4"
        ),
        pytest.param({"fracgpu.io/gpu": "1"}, [], [], id="whole-card-no-model-known"),
        pytest.param({"fracgpu.io/gpu": "2"}, ["l4", "h100"], ["l4", "h100"], id="two-cards-mixed"),
        pytest.param({"fracgpu.io/gpu": "0.5"}, ["h100"], ["l4", "h100"], id="l4-pool-appears"),
        pytest.param(
            {"fracgpu.io/gpumem": "24576"}, ["h100"], ["l4", "h100"], id="memory-l4-pool-appears"
        ),
        pytest.param({"fracgpu.io/gpu": "0.3"}, ["l4", "h100"], ["h100"], id="l4-pool-removed"),
        pytest.param(
            {"fracgpu.io/gpu": "0.5", "fracgpu.io/gpumem": "40Gi"},
            ["h100"],
            ["l4"],
            id="h100-pool-scaled-to-zero",
        ),
    ],
)
def test_deployment_replicaset_pod_chain_is_admitted_unchanged(
    limits: dict[str, Any], before: list[str], after: list[str]
) -> None:
    """Each object of the chain carries what admission wrote on the first; it must pass as is,
    even when the GPU models the cluster knows changed in between."""
    inv = Inventory()
    m = Mutator(AdmissionConfig(), inv)
    inv.replace_nodes((n, NODES[n]) for n in before)
    deploy = admitted(m, deployment("Deployment", "apps", limits), "apps", "Deployment")
    inv.replace_nodes((n, NODES[n]) for n in after)
    rs = replicaset_from(deploy)
    assert m.mutate(rs, "apps", "ReplicaSet").patch == []
    assert m.mutate(rs, "apps", "ReplicaSet").errors == []
    made = pod_from(rs)
    assert m.mutate(made, "", "Pod").patch == []
    assert m.mutate(made, "", "Pod").errors == []


def test_memory_only_over_the_smallest_model_is_a_share_of_the_model_that_holds_it() -> None:
    inv = Inventory()
    inv.replace_nodes(NODES.items())
    out = apply(
        Mutator(AdmissionConfig(), inv), pod(container("c", {"fracgpu.io/gpumem": "24576"}))
    )
    c = out["spec"]["containers"][0]
    assert c["resources"]["limits"] == {"fracgpu.io/core": "31", "fracgpu.io/memory": "96"}
    assert c["env"] == [
        {"name": "FRACGPU_GPU", "value": "0.31"},
        {"name": "FRACGPU_MEMORY_MIB", "value": "24576"},
    ]


@pytest.mark.parametrize(
    "inventory",
    [pytest.param({}, id="no-model-known"), pytest.param(INVENTORY, id="model-known")],
)
def test_whole_cards_are_core_only_and_the_node_tells_the_memory(inventory: dict[str, int]) -> None:
    out = apply(
        Mutator(AdmissionConfig(), Inventory(inventory)),
        pod(container("c", {"fracgpu.io/gpu": "2"})),
    )
    c = out["spec"]["containers"][0]
    assert c["resources"] == {
        "limits": {"fracgpu.io/core": "200"},
        "requests": {"fracgpu.io/core": "200"},
    }
    assert c["env"] == [{"name": "FRACGPU_GPU", "value": "2"}]


def test_earlier_whole_card_admissions_pass_unchanged() -> None:
    """A template admitted by an earlier version carries memory and its variable: kept."""
    old = container(
        "c",
        {"fracgpu.io/core": "200", "fracgpu.io/memory": "636"},
        env=[
            {"name": "FRACGPU_GPU", "value": "2"},
            {"name": "FRACGPU_MEMORY_MIB", "value": "81408"},
        ],
    )
    old["resources"]["requests"] = dict(old["resources"]["limits"])
    obj = pod(old)
    obj["metadata"]["annotations"] = {"fracgpu.io/request": '{"c":{"fracgpu.io/gpu":"2"}}'}
    obj["spec"]["schedulerName"] = "default-scheduler"
    obj["spec"]["tolerations"] = [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    ]
    outcome = Mutator(AdmissionConfig(scheduler_name=""), Inventory()).mutate(obj, "", "Pod")
    assert (outcome.errors, outcome.patch) == ([], [])


@pytest.mark.parametrize(
    ("limits", "env"),
    [
        pytest.param(
            {"fracgpu.io/gpu": "2"},
            {"name": "FRACGPU_MEMORY_MIB", "value": "81408"},
            id="memory-variable-on-whole-cards",
        ),
        pytest.param(
            {"fracgpu.io/core": "30", "fracgpu.io/memory": "95"},
            {"name": "FRACGPU_MEMORY_MIB", "value": "24576"},
            id="memory-variable-not-the-grant",
        ),
        pytest.param(
            {"fracgpu.io/core": "30", "fracgpu.io/memory": "95"},
            {"name": "FRACGPU_GPU", "value": "0.30"},
            id="same-number-other-text",
        ),
        pytest.param(
            {"fracgpu.io/core": "30", "fracgpu.io/memory": "95"},
            {"name": "FRACGPU_GPU", "valueFrom": {"configMapKeyRef": {"name": "x", "key": "y"}}},
            id="from-a-config-map",
        ),
    ],
)
def test_system_variables_that_differ_from_the_grant_are_denied(
    limits: dict[str, Any], env: dict[str, Any]
) -> None:
    outcome = mutator().mutate(pod(container("c", limits, env=[env])), "", "Pod")
    assert f"environment variable {env['name']} is set by fracgpu" in outcome.message


# kubectl debug: the pods/ephemeralcontainers subresource ------------------------------------


def debugged(pod_obj: dict[str, Any], **ephemeral: Any) -> AdmissionRequest:
    """The UPDATE kubectl debug sends: the whole pod, with the ephemeral container added."""
    obj = copy.deepcopy(pod_obj)
    obj["spec"]["ephemeralContainers"] = [{"name": "debugger", "image": "busybox", **ephemeral}]
    return AdmissionRequest.model_validate(
        {
            "uid": "u",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "subResource": "ephemeralcontainers",
            "namespace": "ns",
            "operation": "UPDATE",
            "object": obj,
            "oldObject": pod_obj,
        }
    )


ADMITTED_GPU_POD = pod(
    container(
        "app",
        {"fracgpu.io/core": "30", "fracgpu.io/memory": "95"},
        env=[
            {"name": "FRACGPU_GPU", "value": "0.3"},
            {"name": "FRACGPU_MEMORY_MIB", "value": "24320"},
        ],
    )
)
PLAIN_POD = pod(container("web", {"cpu": "1"}))


@pytest.mark.parametrize(
    ("target", "ephemeral", "denied"),
    [
        pytest.param(
            ADMITTED_GPU_POD,
            {"securityContext": {"privileged": True}},
            'container "debugger": is privileged',
            id="privileged-in-a-gpu-pod",
        ),
        pytest.param(
            ADMITTED_GPU_POD,
            {"env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]},
            'container "debugger": environment variable NVIDIA_VISIBLE_DEVICES selects GPUs',
            id="visible-devices-in-a-gpu-pod",
        ),
        pytest.param(
            PLAIN_POD,
            {"env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]},
            'container "debugger": environment variable NVIDIA_VISIBLE_DEVICES selects GPUs',
            id="visible-devices-in-a-plain-pod",
        ),
        pytest.param(
            ADMITTED_GPU_POD,
            {"env": [{"name": "FRACGPU_GPU", "value": "1"}]},
            'container "debugger": environment variable FRACGPU_GPU is set by fracgpu',
            id="system-variable",
        ),
        pytest.param(
            ADMITTED_GPU_POD,
            {"volumeMounts": [{"name": "v", "mountPath": "/run/fracgpu/limits"}]},
            'container "debugger": volume mount at /run/fracgpu/limits covers',
            id="reserved-mount",
        ),
        pytest.param(
            PLAIN_POD,
            {"volumeMounts": [{"name": "v", "mountPath": "/var/run/nvidia-container-devices/a"}]},
            'container "debugger": volume mount at /var/run/nvidia-container-devices/a selects',
            id="device-list-mount",
        ),
        pytest.param(
            ADMITTED_GPU_POD,
            {"resources": {"limits": {"fracgpu.io/gpu": "1"}}},
            'container "debugger": is an ephemeral container and asks for fracgpu.io/gpu; '
            "ephemeral containers get no GPU, remove the resources",
            id="asks-for-a-gpu",
        ),
    ],
)
async def test_ephemeral_containers_are_checked(
    target: dict[str, Any], ephemeral: dict[str, Any], denied: str
) -> None:
    response = await mutator()(debugged(target, **ephemeral))
    assert response.status is not None
    assert denied in response.status.message


@pytest.mark.parametrize(
    ("target", "ephemeral"),
    [
        pytest.param(ADMITTED_GPU_POD, {}, id="plain-debugger-in-a-gpu-pod"),
        pytest.param(PLAIN_POD, {"securityContext": {"privileged": True}}, id="privileged-no-gpu"),
    ],
)
async def test_harmless_ephemeral_containers_pass_without_a_patch(
    target: dict[str, Any], ephemeral: dict[str, Any]
) -> None:
    response = await mutator(scheduler_name="fracgpu-scheduler")(debugged(target, **ephemeral))
    assert response.allowed
    assert response.patch is None


@settings(max_examples=200, deadline=None)
@given(obj=pod_json)
async def test_hostile_ephemeral_container_updates_get_an_answer(obj: Any) -> None:
    """Whatever kubectl debug's subresource carries, the reply is an allow or a 422 denial."""
    request = AdmissionRequest.model_validate(
        {
            "uid": "u",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "subResource": "ephemeralcontainers",
            "operation": "UPDATE",
            "object": obj if isinstance(obj, dict) else {"spec": obj},
        }
    )
    response = await mutator()(request)
    assert response.allowed or (response.status is not None and response.status.code == 422)


# Choosing the GPU model in pod annotations (issue #28 item 4) ------------------------------

GPU_MODEL = "fracgpu.io/gpu-model"
GPU_MODEL_EXCLUDE = "fracgpu.io/gpu-model-exclude"
PRODUCT_KEY = "fracgpu.io/gpu.product"
REQUIRED = "requiredDuringSchedulingIgnoredDuringExecution"


def mixed_mutator(*dialects: Dialect) -> Mutator:
    inv = Inventory()
    inv.replace_nodes(NODES.items())
    return Mutator(AdmissionConfig(dialects=list(dialects)), inv)


def chosen_pod(annotations: dict[str, Any], limits: dict[str, Any], **spec: Any) -> Any:
    obj = pod(container("c", limits), **spec)
    obj["metadata"]["annotations"] = dict(annotations)
    return obj


def terms(obj: dict[str, Any]) -> Any:
    return obj["spec"]["affinity"]["nodeAffinity"][REQUIRED]["nodeSelectorTerms"]


def expr(operator: str, *values: str) -> dict[str, Any]:
    return {"key": PRODUCT_KEY, "operator": operator, "values": list(values)}


ZONE_A = {"key": "zone", "operator": "In", "values": ["a"]}
ZONE_B = {"key": "zone", "operator": "In", "values": ["b"]}
TWO_TERMS = {
    "nodeAffinity": {
        REQUIRED: {
            "nodeSelectorTerms": [{"matchExpressions": [ZONE_A]}, {"matchExpressions": [ZONE_B]}]
        }
    }
}


@pytest.mark.parametrize(
    ("annotations", "spec", "dialects", "expected"),
    [
        pytest.param(
            {GPU_MODEL: "NVIDIA-L4"},
            {},
            (),
            [{"matchExpressions": [expr("In", "NVIDIA-L4")]}],
            id="one-model",
        ),
        pytest.param(
            {GPU_MODEL: "nvidia l4"},
            {},
            (),
            [{"matchExpressions": [expr("In", "NVIDIA-L4")]}],
            id="written-with-space-and-lower-case",
        ),
        pytest.param(
            {GPU_MODEL: "NVIDIA-L4,NVIDIA-H100-80GB-HBM3"},
            {},
            (),
            [{"matchExpressions": [expr("In", "NVIDIA-H100-80GB-HBM3", "NVIDIA-L4")]}],
            id="two-models",
        ),
        pytest.param(
            {GPU_MODEL_EXCLUDE: "NVIDIA-L4"},
            {},
            (),
            [{"matchExpressions": [expr("NotIn", "NVIDIA-L4")]}],
            id="exclude",
        ),
        pytest.param(
            {GPU_MODEL: "NVIDIA-L4"},
            {"affinity": TWO_TERMS},
            (),
            [
                {"matchExpressions": [ZONE_A, expr("In", "NVIDIA-L4")]},
                {"matchExpressions": [ZONE_B, expr("In", "NVIDIA-L4")]},
            ],
            id="each-term-gets-it",
        ),
        pytest.param(
            {GPU_MODEL: "NVIDIA-L4"},
            {
                "affinity": {
                    "nodeAffinity": {REQUIRED: {"nodeSelectorTerms": [{"matchFields": []}]}}
                }
            },
            (),
            [{"matchFields": [], "matchExpressions": [expr("In", "NVIDIA-L4")]}],
            id="term-of-fields-only",
        ),
        pytest.param(
            {GPU_MODEL: "NVIDIA-L4"},
            {"nodeSelector": {PRODUCT_KEY: "NVIDIA-L4"}},
            (),
            [{"matchExpressions": [expr("In", "NVIDIA-L4")]}],
            id="agrees-with-node-selector",
        ),
        pytest.param(
            {"nvidia.com/use-gputype": "l4"},
            {},
            (Dialect.HAMI,),
            [{"matchExpressions": [expr("In", "NVIDIA-L4")]}],
            id="hami-part-of-name",
        ),
        pytest.param(
            {"nvidia.com/nouse-gputype": "H100"},
            {},
            (Dialect.HAMI,),
            [{"matchExpressions": [expr("NotIn", "NVIDIA-H100-80GB-HBM3")]}],
            id="hami-exclude",
        ),
    ],
)
def test_model_choice_becomes_required_node_affinity(
    annotations: dict[str, Any],
    spec: dict[str, Any],
    dialects: tuple[Dialect, ...],
    expected: list[dict[str, Any]],
) -> None:
    out = apply(mixed_mutator(*dialects), chosen_pod(annotations, {"fracgpu.io/gpu": "1"}, **spec))
    assert terms(out) == expected


def test_preferred_node_affinity_is_kept_beside_the_written_requirement() -> None:
    preferred = [{"weight": 1, "preference": {"matchExpressions": [ZONE_A]}}]
    spec = {
        "affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": preferred}}
    }
    out = apply(
        mixed_mutator(), chosen_pod({GPU_MODEL: "NVIDIA-L4"}, {"fracgpu.io/gpu": "1"}, **spec)
    )
    assert (
        out["spec"]["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
        == preferred
    )


@pytest.mark.parametrize(
    ("annotations", "memory"),
    [
        pytest.param({GPU_MODEL: "NVIDIA-H100-80GB-HBM3"}, "159", id="h100-chosen"),
        pytest.param({GPU_MODEL_EXCLUDE: "NVIDIA-L4"}, "159", id="l4-excluded"),
        pytest.param({GPU_MODEL: "NVIDIA-L4"}, "44", id="l4-chosen"),
        pytest.param({}, "44", id="no-choice-smallest"),
    ],
)
def test_a_fraction_is_sized_for_the_chosen_models(
    annotations: dict[str, Any], memory: str
) -> None:
    out = apply(mixed_mutator(), chosen_pod(annotations, {"fracgpu.io/gpu": "0.5"}))
    assert blocks(out) == memory


def test_hami_choice_is_written_in_fracgpu_annotations_for_quota() -> None:
    annotations = {"nvidia.com/use-gputype": "NVIDIA"}
    annotations["nvidia.com/nouse-gputype"] = "L4"
    out = apply(mixed_mutator(Dialect.HAMI), chosen_pod(annotations, {"fracgpu.io/gpu": "1"}))
    assert out["metadata"]["annotations"][GPU_MODEL] == "NVIDIA-H100-80GB-HBM3"


def test_hami_annotations_are_left_alone_when_the_dialect_is_off() -> None:
    obj = chosen_pod({"nvidia.com/use-gputype": "B200"}, {"fracgpu.io/gpu": "1"})
    out = apply(mixed_mutator(), obj)
    assert "affinity" not in out["spec"]


@pytest.mark.parametrize(
    ("annotations", "spec", "expected"),
    [
        pytest.param(
            {GPU_MODEL: "H1000"},
            {},
            "fracgpu.io/gpu-model 'H1000' matches no GPU model in this cluster",
            id="unknown-model",
        ),
        pytest.param(
            {GPU_MODEL: "H1000"},
            {},
            "known: NVIDIA-H100-80GB-HBM3, NVIDIA-L4; write one of them, comma-separated",
            id="unknown-model-lists-known",
        ),
        pytest.param(
            {GPU_MODEL_EXCLUDE: "NVIDIA-L4,NVIDIA-H100-80GB-HBM3"},
            {},
            "no GPU model of this cluster is left",
            id="excludes-every-model",
        ),
        pytest.param({GPU_MODEL: ""}, {}, "annotation fracgpu.io/gpu-model is empty", id="empty"),
        pytest.param({GPU_MODEL: "NVIDIA-L4,,"}, {}, "has an empty entry", id="double-comma"),
        pytest.param({GPU_MODEL: "NVIDIA-L4,nvidia-l4"}, {}, "twice", id="duplicate"),
        pytest.param({GPU_MODEL: 3}, {}, "must be a string", id="not-a-string"),
        pytest.param({GPU_MODEL: {"a": 1}}, {}, "must be a string", id="a-map"),
        pytest.param(
            {GPU_MODEL: "NVIDIA-L4"},
            {"nodeSelector": {PRODUCT_KEY: "NVIDIA-H100-80GB-HBM3"}},
            "choose the model in one place",
            id="contradicts-node-selector",
        ),
        pytest.param(
            {GPU_MODEL_EXCLUDE: "NVIDIA-L4"},
            {"nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-L4"}},
            "pins nvidia.com/gpu.product to NVIDIA-L4",
            id="excludes-the-pinned-model",
        ),
    ],
)
def test_model_choice_denials_say_how_to_fix(
    annotations: dict[str, Any], spec: dict[str, Any], expected: str
) -> None:
    outcome = mixed_mutator().mutate(
        chosen_pod(annotations, {"fracgpu.io/gpu": "0.5"}, **spec), "", "Pod"
    )
    assert expected in outcome.message


def test_model_choice_on_a_pod_without_gpu_is_left_alone() -> None:
    obj = chosen_pod({GPU_MODEL: "H1000"}, {"cpu": "1"})
    assert mixed_mutator().mutate(obj, "", "Pod").patch == []


@pytest.mark.parametrize(
    ("annotations", "before", "after"),
    [
        pytest.param({GPU_MODEL: "nvidia-l4"}, ["l4", "h100"], ["l4", "h100"], id="same-models"),
        pytest.param(
            {GPU_MODEL: "nvidia-l4"}, ["l4", "h100"], ["h100"], id="l4-pool-scaled-to-zero"
        ),
        pytest.param({GPU_MODEL: "NVIDIA-L4"}, ["l4"], [], id="no-model-known-later"),
        pytest.param({GPU_MODEL: "NVIDIA-L4"}, [], [], id="no-model-known-ever"),
        pytest.param({GPU_MODEL_EXCLUDE: "NVIDIA-L4"}, ["l4", "h100"], ["h100"], id="exclude"),
        pytest.param(
            {"nvidia.com/use-gputype": "nvidia"},
            ["l4"],
            ["h100"],
            id="hami-part-of-name-matches-another-model-now",
        ),
    ],
)
def test_model_choice_chain_is_admitted_unchanged(
    annotations: dict[str, Any], before: list[str], after: list[str]
) -> None:
    """A Deployment's ReplicaSet and pods carry the affinity written on the Deployment: admitting
    them again adds no second expression, even when the known models changed."""
    inv = Inventory()
    m = Mutator(AdmissionConfig(dialects=[Dialect.HAMI]), inv)
    inv.replace_nodes((n, NODES[n]) for n in before)
    deploy = deployment("Deployment", "apps", {"fracgpu.io/gpu": "1"})
    deploy["spec"]["template"]["metadata"]["annotations"] = dict(annotations)
    deploy = admitted(m, deploy, "apps", "Deployment")
    inv.replace_nodes((n, NODES[n]) for n in after)
    made = pod_from(replicaset_from(deploy))
    assert m.mutate(made, "", "Pod").patch == []
    assert m.mutate(made, "", "Pod").errors == []


def test_a_model_unknown_without_any_model_known_is_written_as_a_label_value() -> None:
    m = Mutator(AdmissionConfig(), Inventory())
    out = apply(m, chosen_pod({GPU_MODEL: "NVIDIA B200"}, {"fracgpu.io/gpu": "1"}))
    assert terms(out) == [{"matchExpressions": [expr("In", "NVIDIA-B200")]}]


# ---- burst and priority: the policy written where the device plugin reads it -----------------


POLICY = "fracgpu.io/compute-policy"


def bursting(name: str = "main", request: str = "0.3", limit: str = "1") -> dict[str, Any]:
    c = container(name)
    c["resources"] = {
        "requests": {"fracgpu.io/gpu": request},
        "limits": {"fracgpu.io/gpu": limit, "fracgpu.io/gpumem": "8Gi"},
    }
    return c


def annotations(obj: dict[str, Any]) -> dict[str, str]:
    found: dict[str, str] = obj["metadata"].get("annotations", {})
    return found


@pytest.mark.parametrize(
    ("obj", "policy"),
    [
        pytest.param(pod(bursting()), '{"main":{"ceiling":100,"priority":"low"}}',
                     id="guaranteed-0.3-bursting-to-the-card"),
        pytest.param(
            {**pod(bursting(limit="0.6")),
             "metadata": {"annotations": {"fracgpu.io/gpu-priority": "high"}}},
            '{"main":{"ceiling":60,"priority":"high"}}',
            id="high-priority-bursting-to-0.6",
        ),
        pytest.param(pod(container("main", {"fracgpu.io/gpu": "0.3"})), None,
                     id="a-hard-cap-writes-none"),
        pytest.param(
            {**pod(container("main", {"fracgpu.io/gpu": "0.3"})),
             "metadata": {"annotations": {POLICY: '{"main":{"ceiling":100}}'}}},
            None,
            id="a-users-own-policy-on-a-hard-cap-is-removed",
        ),
    ],
)  # fmt: skip
def test_a_bursting_share_is_canonical_at_its_guarantee_with_its_policy_beside(
    obj: dict[str, Any], policy: str | None
) -> None:
    out = apply(mutator(), obj)
    resources = out["spec"]["containers"][0]["resources"]
    assert (
        resources["limits"]["fracgpu.io/core"] == resources["requests"]["fracgpu.io/core"] == "30"
    )
    assert annotations(out).get("fracgpu.io/compute-policy") == policy


def test_a_template_made_pod_keeps_the_policy_its_workload_was_given() -> None:
    """Deployment → pod: the pod arrives canonical with the annotations and passes as it is,
    without a warning."""
    obj = deployment("Deployment", "apps", {})
    obj["spec"]["template"]["spec"]["containers"] = [bursting("c")]
    obj["spec"]["template"]["metadata"]["annotations"] = {"fracgpu.io/gpu-priority": "high"}
    out = apply(mutator(), obj, "apps", "Deployment")
    template = out["spec"]["template"]
    assert annotations(template)["fracgpu.io/compute-policy"] == (
        '{"c":{"ceiling":100,"priority":"high"}}'
    )
    made = {"apiVersion": "v1", "kind": "Pod", **template}
    assert apply(mutator(), made) == made
    assert mutator().mutate(made, "", "Pod").warnings == []


def test_a_priority_that_is_no_priority_is_denied() -> None:
    obj = {**pod(bursting()), "metadata": {"annotations": {"fracgpu.io/gpu-priority": "urgent"}}}
    outcome = mutator().mutate(obj, "", "Pod")
    assert outcome.errors == [
        'annotation fracgpu.io/gpu-priority must be high or low (the default); got "urgent"; '
        "high-priority shares borrow idle compute before low ones"
    ]


def test_a_priority_without_a_bursting_share_warns_it_has_no_effect() -> None:
    obj = {
        **pod(container("main", {"fracgpu.io/gpu": "0.3"})),
        "metadata": {"annotations": {"fracgpu.io/gpu-priority": "high"}},
    }
    outcome = mutator().mutate(obj, "", "Pod")
    assert outcome.allowed
    assert any("has no effect" in w for w in outcome.warnings)
