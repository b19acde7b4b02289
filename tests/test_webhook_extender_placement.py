"""Admission with extender placement (issue #38, docs/design/extender-memo.md §2.7).

With ``admission.placement: extender`` every GPU pod goes to the fracgpu scheduler whatever its
Lease says, and what would skip that scheduler's extender (a preset ``spec.nodeName``, another
``schedulerName``) is denied with a message naming the field, the value and the fix; a forged
placement record is denied in every mode. kubectl debug on a pod the extender bound still works.
Node mode and DRA mode answer exactly as before. The configuration follows ``extender.enabled``
and ``fracgpu serve`` refuses a contradiction; a GPU pod left to a scheduler that is down is
told so by an Event. The ValidatingAdmissionPolicy docs/device-plugin.md proposes for what the
webhook never sees (pod updates) freezes the record.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import json
from pathlib import Path
from typing import Any

import jsonpatch
import pytest
import yaml

from core.admission import AdmissionRequest
from core.kube import kube_client
from core.placement import PLACEMENT_ANNOTATION
from fracgpu.cli import admission_config, build_parser
from fracgpu.serve import load
from testkit.apiserver import DEFAULT_NAMESPACES, FakeApiServer
from tests.deploy_render import policy_admits
from tests.support import eventually
from webhook.config import AdmissionConfig, ConfigError
from webhook.gpumodels import GpuModel
from webhook.inventory import Inventory
from webhook.mutation import Mutator, respond
from webhook.waiting import scheduler_down, unscheduled_by
from webhook.waitwatch import WaitExplainer

PROFILE = "fracgpu-scheduler"
INVENTORY = {"NVIDIA-H100-80GB-HBM3": 81559}
SHARE = {"fracgpu.io/gpu": "300m"}
RECORD = '{"v":1,"node":"gpu-1","containers":{"main":{"cards":["GPU-1"],"core":30}}}'
DOWN = "its Lease fracgpu/fracgpu-scheduler does not exist"


class Presence:
    """A scheduler Lease as webhook.schedwatch reads it: renewed (None) or why it is not."""

    def __init__(self, why: str | None) -> None:
        self.why = why

    def not_running(self) -> str | None:
        return self.why


def mutator(presence: Presence | None = None, **config: Any) -> Mutator:
    return Mutator(AdmissionConfig(**config), Inventory(INVENTORY), presence)


def extender(presence: Presence | None = None, **config: Any) -> Mutator:
    return mutator(presence, placement="extender", scheduler_name=PROFILE, **config)


def pod(limits: dict[str, Any] | None = SHARE, meta: Any = None, **spec: Any) -> dict[str, Any]:
    main: dict[str, Any] = {"name": "main", "image": "python:3.11"}
    if limits is not None:
        main["resources"] = {"limits": limits}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "infer", "namespace": "team-a", **(meta or {})},
        "spec": {"containers": [main], **spec},
    }


def deployment(template_spec: dict[str, Any]) -> dict[str, Any]:
    template = pod(**template_spec)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "infer", "namespace": "team-a"},
        "spec": {"template": {"metadata": {}, "spec": template["spec"]}},
    }


def scheduler_ops(patch: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [op for op in patch if "schedulerName" in op["path"]]


# --- every GPU pod goes to the fracgpu scheduler, whatever its Lease says ------------------------

SET = {"op": "add", "path": "/spec/schedulerName", "value": PROFILE}
REPLACED = {"op": "replace", "path": "/spec/schedulerName", "value": PROFILE}
WAITS = (
    f"scheduler {PROFILE} is not running ({DOWN}); the pod waits Pending until it runs: its "
    f"GPU card is chosen only by that scheduler's extender (admission.placement: extender)"
)


@pytest.mark.parametrize(
    ("spec", "why", "ops", "warnings"),
    [
        pytest.param({}, None, [SET], [], id="unset-scheduler-running"),
        pytest.param({}, DOWN, [SET], [WAITS], id="unset-scheduler-down-still-handed-over"),
        pytest.param(
            {"schedulerName": "default-scheduler"}, None, [REPLACED], [], id="default-replaced"
        ),
        pytest.param(
            {"schedulerName": "default-scheduler"}, DOWN, [REPLACED], [WAITS], id="default-down"
        ),
        pytest.param({"schedulerName": ""}, None, [REPLACED], [], id="empty-replaced"),
        pytest.param({"schedulerName": PROFILE}, None, [], [], id="already-ours"),
        pytest.param({"schedulerName": PROFILE}, DOWN, [], [WAITS], id="already-ours-down-told"),
        pytest.param({"nodeName": ""}, None, [SET], [], id="empty-node-name-is-unset"),
    ],
)
def test_gpu_pods_are_handed_to_the_scheduler_unconditionally(
    spec: dict[str, Any], why: str | None, ops: list[dict[str, Any]], warnings: list[str]
) -> None:
    m = extender(Presence(why))
    obj = pod(**spec)
    outcome = m.mutate(obj, "", "Pod")
    assert outcome.errors == []
    assert scheduler_ops(outcome.patch) == ops
    assert outcome.warnings == warnings
    patched = jsonpatch.apply_patch(obj, outcome.patch)
    again = m.mutate(patched, "", "Pod")
    assert (again.errors, again.patch) == ([], [])  # reinvocation changes nothing


def test_override_scheduler_still_replaces_a_named_scheduler() -> None:
    outcome = extender(override_scheduler=True).mutate(pod(schedulerName="volcano"), "", "Pod")
    assert outcome.errors == []
    assert scheduler_ops(outcome.patch) == [REPLACED]


def test_a_pod_without_a_gpu_is_left_alone() -> None:
    outcome = extender().mutate(pod({"cpu": "1"}, nodeName="n", schedulerName="x"), "", "Pod")
    assert (outcome.errors, outcome.patch, outcome.gpu) == ([], [], False)


def test_a_mirror_pod_keeps_its_node() -> None:
    """kubelet's copy of a static pod runs there whatever admission says; refusing it would
    only hide it."""
    mirror = pod(meta={"annotations": {"kubernetes.io/config.mirror": "abc"}}, nodeName="gpu-1")
    outcome = extender().mutate(mirror, "", "Pod")
    assert outcome.errors == []


def test_templates_never_carry_the_scheduler() -> None:
    """Each pod is handed over when it is created, as in node mode."""
    outcome = extender().mutate(deployment({}), "apps", "Deployment")
    assert outcome.errors == []
    assert scheduler_ops(outcome.patch) == []


# --- what would skip the extender is denied ----------------------------------------------------

NODE_NAME = (
    'spec.nodeName is set ("gpu-1"): GPU pods are placed by scheduler fracgpu-scheduler, whose '
    "extender books the pod's card and records it as it binds the pod (admission.placement: "
    "extender); a pod created bound skips it, with no card booked or recorded; remove "
    "spec.nodeName (to keep the pod on one node, use a nodeSelector on kubernetes.io/hostname)"
)
SCHEDULER = (
    'spec.schedulerName is "volcano": GPU pods are scheduled by fracgpu-scheduler, whose extender '
    "books the pod's card and records it as it binds the pod (admission.placement: extender); "
    "another scheduler would bind it with no card recorded; remove spec.schedulerName or set it "
    "to fracgpu-scheduler"
)
FORGED = (
    f"annotation {PLACEMENT_ANNOTATION} is the card fracgpu's scheduler extender records when it "
    f"binds a GPU pod, written only with the pod's binding; a pod cannot set it (the device "
    f"plugin would place the pod on the cards it names); remove it"
)


def in_template(message: str) -> str:
    return message.replace("spec.", "spec.template.spec.")


@pytest.mark.parametrize(
    ("obj", "kind", "errors"),
    [
        pytest.param(pod(nodeName="gpu-1"), "Pod", [NODE_NAME], id="node-name-preset"),
        pytest.param(pod(schedulerName="volcano"), "Pod", [SCHEDULER], id="another-scheduler"),
        pytest.param(
            pod(nodeName="gpu-1", schedulerName="volcano"),
            "Pod",
            [NODE_NAME, SCHEDULER],
            id="both-named-at-once",
        ),
        pytest.param(
            pod(schedulerName={"not": "a name"}),
            "Pod",
            [SCHEDULER.replace('"volcano"', '{"not": "a name"}')],
            id="scheduler-not-a-string-quoted",
        ),
        pytest.param(
            pod(meta={"annotations": {PLACEMENT_ANNOTATION: RECORD}}),
            "Pod",
            [FORGED],
            id="forged-record",
        ),
        pytest.param(
            deployment({"nodeName": "gpu-1"}),
            "Deployment",
            [in_template(NODE_NAME)],
            id="template-node-name",
        ),
        pytest.param(
            deployment({"schedulerName": "volcano"}),
            "Deployment",
            [in_template(SCHEDULER)],
            id="template-another-scheduler",
        ),
    ],
)
def test_what_would_skip_the_extender_is_denied(
    obj: dict[str, Any], kind: str, errors: list[str]
) -> None:
    group = "apps" if kind == "Deployment" else ""
    outcome = extender().mutate(obj, group, kind)
    assert outcome.errors == errors
    assert outcome.patch == []
    response = respond("u", outcome)
    assert response.status is not None and response.status.code == 422


@pytest.mark.parametrize(
    "config",
    [
        pytest.param({}, id="node-mode"),
        pytest.param({"scheduler_name": PROFILE}, id="node-mode-with-profile"),
        pytest.param({"allocation": "dra"}, id="dra-mode"),
    ],
)
def test_a_forged_record_is_denied_in_every_mode(config: dict[str, Any]) -> None:
    """In the mode node the plugin never reads it, but the pod could still be running the day
    the nodes switch to extender placement."""
    m = Mutator(
        AdmissionConfig(**config),
        Inventory(INVENTORY),
        claim_models=lambda: {"NVIDIA-L4": GpuModel("NVIDIA-L4", 23034)},
    )
    outcome = m.mutate(pod(meta={"annotations": {PLACEMENT_ANNOTATION: RECORD}}), "", "Pod")
    assert outcome.errors == [FORGED]


# --- kubectl debug on a pod the extender bound -------------------------------------------------


def bound() -> dict[str, Any]:
    """A GPU pod as the extender's Binding left it: node set, record written."""
    admitted = pod(
        {"fracgpu.io/core": "30", "fracgpu.io/memory": "95"},
        meta={"annotations": {PLACEMENT_ANNOTATION: RECORD}},
        nodeName="gpu-1",
        schedulerName=PROFILE,
    )
    admitted["spec"]["containers"][0]["env"] = [
        {"name": "FRACGPU_GPU", "value": "0.3"},
        {"name": "FRACGPU_MEMORY_MIB", "value": "24320"},
    ]
    return admitted


def debugged(target: dict[str, Any], **ephemeral: Any) -> AdmissionRequest:
    obj = copy.deepcopy(target)
    obj["spec"]["ephemeralContainers"] = [{"name": "debugger", "image": "busybox", **ephemeral}]
    return AdmissionRequest.model_validate(
        {
            "uid": "u",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "subResource": "ephemeralcontainers",
            "namespace": "team-a",
            "operation": "UPDATE",
            "object": obj,
            "oldObject": target,
        }
    )


@pytest.mark.parametrize(
    ("ephemeral", "denied"),
    [
        pytest.param({}, None, id="plain-debugger-allowed"),
        pytest.param(
            {"securityContext": {"privileged": True}},
            'container "debugger": is privileged',
            id="privileged-debugger-still-denied",
        ),
    ],
)
async def test_kubectl_debug_on_a_pod_the_extender_bound(
    ephemeral: dict[str, Any], denied: str | None
) -> None:
    """Its node and record were written by its Binding, not by whoever debugs it."""
    response = await extender()(debugged(bound(), **ephemeral))
    if denied is None:
        assert response.allowed and response.patch is None
    else:
        assert response.status is not None and denied in response.status.message
        assert PLACEMENT_ANNOTATION not in response.status.message
        assert "nodeName" not in response.status.message


# --- node mode and DRA mode answer as before ---------------------------------------------------


def kept(scheduler: str) -> str:
    return (
        f"scheduler {PROFILE} is not running ({DOWN}); the pod keeps {scheduler} so that it "
        f"does not wait unscheduled"
    )


@pytest.mark.parametrize(
    ("obj", "warnings"),
    [
        pytest.param(pod(nodeName="gpu-1"), [kept("the default scheduler")], id="node-name"),
        pytest.param(pod(schedulerName="volcano"), [], id="another-scheduler-kept"),
        pytest.param(pod(), [kept("the default scheduler")], id="scheduler-down"),
        pytest.param(
            pod(schedulerName="default-scheduler"),
            [kept("default-scheduler")],
            id="default-scheduler-down",
        ),
    ],
)
async def test_node_mode_answers_exactly_as_before(
    obj: dict[str, Any], warnings: list[str]
) -> None:
    """Byte for byte what a configuration without the key answers, and the old behaviour:
    admitted, the scheduler handed over only while it runs."""
    request = AdmissionRequest.model_validate(
        {
            "uid": "u",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "namespace": "team-a",
            "operation": "CREATE",
            "object": obj,
        }
    )
    down = Presence(DOWN)
    before = await mutator(down, scheduler_name=PROFILE)(request)
    explicit = await mutator(down, scheduler_name=PROFILE, placement="node")(request)
    assert explicit.model_dump_json() == before.model_dump_json()
    assert before.allowed
    assert before.patch is not None
    assert scheduler_ops(json.loads(base64.b64decode(before.patch))) == []
    assert (before.warnings or []) == warnings


def test_dra_mode_ignores_the_extender_rules() -> None:
    """DRA mode cannot be configured with extender placement (the stock scheduler places
    claims); its pods keep a preset node and their scheduler as before."""
    m = Mutator(
        AdmissionConfig(allocation="dra"),
        Inventory(),
        claim_models=lambda: {"NVIDIA-L4": GpuModel("NVIDIA-L4", 23034)},
    )
    outcome = m.mutate(pod(nodeName="gpu-1", schedulerName="volcano"), "", "Pod")
    assert outcome.errors == []
    assert scheduler_ops(outcome.patch) == []


# --- configuration ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "problem"),
    [
        pytest.param(
            {"placement": "extender"},
            "extender placement needs scheduler_name: the scheduler profile that calls the "
            "extender (deploy/overlays/default runs fracgpu-scheduler)",
            id="no-scheduler",
        ),
        pytest.param(
            {"placement": "extender", "scheduler_name": PROFILE, "allocation": "dra"},
            "extender placement is for device-plugin mode",
            id="dra-mode",
        ),
        pytest.param({"placement": "elsewhere"}, "Input should be 'node' or 'extender'", id="typo"),
    ],
)
def test_placement_settings_that_cannot_work(config: dict[str, Any], problem: str) -> None:
    with pytest.raises(ValueError, match="placement") as caught:
        AdmissionConfig(**config)
    assert problem in str(caught.value)


@pytest.mark.parametrize(
    ("config", "extender_placement"),
    [
        pytest.param({}, False, id="default-node"),
        pytest.param({"placement": "extender", "scheduler_name": PROFILE}, True, id="auto"),
        pytest.param(
            {"placement": "extender", "scheduler_name": PROFILE, "allocation": "device-plugin"},
            True,
            id="device-plugin",
        ),
    ],
)
def test_extender_placement_setting(config: dict[str, Any], extender_placement: bool) -> None:
    assert AdmissionConfig(**config).extender_placement is extender_placement


def write(tmp_path: Path, document: dict[str, Any]) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


ADMISSION = {"scheduler_name": PROFILE}


@pytest.mark.parametrize(
    ("document", "placement"),
    [
        pytest.param({"admission": ADMISSION}, "node", id="no-extender-node"),
        pytest.param(
            {"admission": ADMISSION, "extender": {"enabled": True}},
            "extender",
            id="extender-enabled-follows",
        ),
        pytest.param(
            {"admission": ADMISSION, "extender": {"enabled": "true"}},
            "extender",
            id="extender-enabled-as-serve-reads-it",
        ),
        pytest.param(
            {"admission": ADMISSION, "extender": {"enabled": False}},
            "node",
            id="extender-disabled",
        ),
        pytest.param(
            {"admission": {**ADMISSION, "placement": "extender"}, "extender": {"enabled": True}},
            "extender",
            id="both-said",
        ),
    ],
)
def test_serve_places_by_the_extender_exactly_when_it_serves_it(
    tmp_path: Path, document: dict[str, Any], placement: str
) -> None:
    args = build_parser().parse_args(["serve", "--config", str(write(tmp_path, document))])
    admission = admission_config(args, document)
    assert admission.placement == placement
    assert load(args, admission, document).admission.placement == placement


@pytest.mark.parametrize(
    ("document", "flags", "problem"),
    [
        pytest.param(
            {"admission": {**ADMISSION, "placement": "node"}, "extender": {"enabled": True}},
            [],
            "extender.enabled is true but admission.placement is node",
            id="served-but-unused",
        ),
        pytest.param(
            {"admission": {**ADMISSION, "placement": "extender"}},
            [],
            "admission.placement is extender but extender.enabled is false: every GPU pod "
            "would wait on scheduler fracgpu-scheduler",
            id="used-but-not-served",
        ),
        pytest.param(
            {"extender": {"enabled": True}},
            [],
            "admission: placement: Value error, extender placement needs scheduler_name: the "
            "scheduler profile that calls the extender (deploy/overlays/default runs "
            "fracgpu-scheduler); without it GPU pods would be bound with no card recorded "
            "(admission.placement follows extender.enabled: true)",
            id="no-scheduler-name",
        ),
        pytest.param(
            {"admission": ADMISSION, "extender": {"enabled": True}},
            ["--scheduler-name", ""],
            "--scheduler-name '': extender placement needs scheduler_name",
            id="scheduler-name-flag-emptied",
        ),
    ],
)
def test_serve_refuses_a_contradiction(
    tmp_path: Path, document: dict[str, Any], flags: list[str], problem: str
) -> None:
    path = write(tmp_path, document)
    args = build_parser().parse_args(["serve", "--config", str(path), *flags])
    with pytest.raises(ConfigError) as caught:
        load(args, admission_config(args, document), document)
    assert problem in str(caught.value)


# --- a GPU pod left to a scheduler that is down is told so --------------------------------------


def waiting(**spec: Any) -> dict[str, Any]:
    obj = pod({"fracgpu.io/core": "30", "fracgpu.io/memory": "95"}, **spec)
    obj["metadata"]["uid"] = "uid-infer"
    obj["status"] = {"phase": "Pending"}
    return obj


@pytest.mark.parametrize(
    ("obj", "unscheduled"),
    [
        pytest.param(waiting(schedulerName=PROFILE), True, id="pending-ours"),
        pytest.param(waiting(schedulerName="default-scheduler"), False, id="another-scheduler"),
        pytest.param(waiting(schedulerName=PROFILE, nodeName="gpu-1"), False, id="bound"),
        pytest.param(
            {**waiting(schedulerName=PROFILE), "status": {"phase": "Running"}},
            False,
            id="running",
        ),
    ],
)
def test_which_pods_wait_on_the_scheduler(obj: dict[str, Any], unscheduled: bool) -> None:
    assert unscheduled_by(obj, PROFILE) is unscheduled


async def test_a_pod_waiting_on_a_stopped_scheduler_gets_an_event(tmp_path: Path) -> None:
    presence = Presence(DOWN)
    async with (
        FakeApiServer(namespaces=(*DEFAULT_NAMESPACES, "team-a")) as fake,
        kube_client(fake.kubeconfig(tmp_path / "kubeconfig")) as api,
    ):
        fake.put(waiting(schedulerName=PROFILE))
        explainer = WaitExplainer(
            api, interval_s=0.05, device_plugin=True, scheduler=(PROFILE, presence)
        )
        task = asyncio.create_task(explainer.run())
        try:
            await eventually(lambda: len(fake.objects("events", "team-a")) == 1)
            [event] = fake.objects("events", "team-a")
            presence.why = None  # running again: nothing more to say
            await asyncio.sleep(0.2)
            assert len(fake.objects("events", "team-a")) == 1
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    assert event["reason"] == "GPUSchedulerNotRunning"
    assert event["message"] == scheduler_down(PROFILE, DOWN)
    assert event["message"] == (
        f"scheduler {PROFILE} is not running ({DOWN}); nothing schedules this pod until it "
        f"runs again; check the Deployment that runs {PROFILE}"
    )


# --- the ValidatingAdmissionPolicy docs/device-plugin.md proposes for pod updates --------------

DOCS = Path(__file__).parent.parent / "docs" / "device-plugin.md"


def proposed_policy() -> dict[str, Any]:
    text = DOCS.read_text()
    start = text.index("```yaml\n# Only the extender's Binding")
    block = text[start + len("```yaml\n") : text.index("```\n", start + 8)]
    policy, binding = yaml.safe_load_all(block)
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]
    data: dict[str, Any] = policy
    return data


def annotated(record: str | None, **others: str) -> dict[str, Any]:
    annotations = {**others, **({} if record is None else {PLACEMENT_ANNOTATION: record})}
    return pod(meta={"annotations": annotations} if annotations else None)


OTHER = '{"v":1,"node":"gpu-2","containers":{"main":{"cards":["GPU-9"],"core":30}}}'


@pytest.mark.parametrize(
    ("operation", "old", "new", "admitted"),
    [
        pytest.param("CREATE", None, annotated(None), True, id="create-without"),
        pytest.param("CREATE", None, annotated(RECORD), False, id="create-forged"),
        pytest.param("UPDATE", annotated(RECORD), annotated(RECORD), True, id="update-unchanged"),
        pytest.param(
            "UPDATE", annotated(RECORD), annotated(RECORD, app="x"), True, id="update-other-key"
        ),
        pytest.param("UPDATE", annotated(None), annotated(None), True, id="update-no-record"),
        pytest.param("UPDATE", annotated(None), annotated(RECORD), False, id="annotate-adds"),
        pytest.param("UPDATE", annotated(RECORD), annotated(OTHER), False, id="annotate-changes"),
        pytest.param("UPDATE", annotated(RECORD), annotated(None), False, id="annotate-removes"),
    ],
)
def test_the_proposed_policy_freezes_the_record(
    operation: str, old: dict[str, Any] | None, new: dict[str, Any], admitted: bool
) -> None:
    policy = proposed_policy()
    (rule,) = policy["spec"]["matchConstraints"]["resourceRules"]
    assert rule["resources"] == ["pods"]  # never pods/binding: the extender writes it there
    request = {"operation": operation, "userInfo": {"username": "alice"}}
    assert policy_admits(policy, request, new, old) is admitted
