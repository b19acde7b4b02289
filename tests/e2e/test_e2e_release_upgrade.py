"""The installed release moved from device-plugin mode to DRA mode with a share running, then
uninstalled: ``helm upgrade --reuse-values --set mode=dra`` replaces the device plugin's
DaemonSet with the DRA plugin's; the running share keeps its container, card, limits and hook;
new shares go through claims; ``helm uninstall`` then leaves nothing on the node.

A module of its own: it installs its own release (never beside test_e2e_release.py's).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from core import contract
from tests.deploy_render import CHART
from tests.e2e.harness import Kubectl, Settings
from tests.e2e.release import (
    AGENT,
    READY_WITHIN_S,
    RELEASE,
    SKIP_REASON,
    Release,
    create_running,
    inside,
    installed,
    limits_inside,
    pods_of,
    published_left,
    ready,
    release_node_of,
    release_state,
    restarts,
    share_pod,
    user_namespace,
    wait_for,
    webhooks_settled,
)


@pytest.fixture(scope="module")
def device_plugin_release(
    settings: Settings, kubectl: Kubectl, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Release]:
    node = release_node_of(settings)
    if node is None:
        pytest.skip(SKIP_REASON)
    workdir = tmp_path_factory.mktemp("upgrade")
    with installed("device-plugin", node, settings, kubectl, workdir) as run:
        yield run


def agents(kubectl: Kubectl, mode: str) -> list[dict[str, object]]:
    return pods_of(kubectl, f"app.kubernetes.io/name={AGENT[mode]}")


def test_helm_upgrade_to_dra_mode_keeps_running_shares_then_uninstall_leaves_nothing(
    device_plugin_release: Release, kubectl: Kubectl
) -> None:
    release = device_plugin_release
    with user_namespace(kubectl) as namespace:
        kept = create_running(kubectl, namespace, share_pod("kept", "0.5", "4Gi"))
        before = limits_inside(kubectl, namespace, "kept")

        release.helm(
            "upgrade", RELEASE, str(CHART), "--reuse-values", "--set", "mode=dra",
            "--wait", "--timeout", f"{int(READY_WITHIN_S)}s", timeout=READY_WITHIN_S + 60,
        )  # fmt: skip
        wait_for(lambda: not agents(kubectl, "device-plugin"), 120,
                 lambda: release_state(kubectl))  # fmt: skip
        wait_for(lambda: any(ready(p) for p in agents(kubectl, "dra")), READY_WITHIN_S,
                 lambda: release_state(kubectl))  # fmt: skip
        # The replicas with the device-plugin configuration answer until they have stopped: a
        # pod created meanwhile may be admitted in the old mode (docs/install.md says so).
        wait_for(lambda: webhooks_settled(kubectl), READY_WITHIN_S,
                 lambda: release_state(kubectl))  # fmt: skip

        # The share the device plugin placed runs on, as it was.
        after = kubectl.get("pod", "kept", namespace)
        assert after["status"]["phase"] == "Running"
        assert after["metadata"]["uid"] == kept["metadata"]["uid"]
        assert restarts(after) == 0
        assert limits_inside(kubectl, namespace, "kept") == before
        preload = inside(kubectl, namespace, "kept", "cat", contract.LD_SO_PRELOAD).split()
        assert preload == [contract.CONTAINER_HOOK_LIBRARY]

        # A new share is admitted and placed in DRA mode: a claim, prepared by the DRA plugin.
        new = create_running(kubectl, namespace, share_pod("new", "0.3", "2Gi"))
        assert new["spec"].get("resourceClaims"), new["spec"]
        granted = limits_inside(kubectl, namespace, "new")
        assert (granted.memory_bytes, granted.compute_percent) == (2 << 30, 30)

        kubectl.ok("delete", "pod", "-n", namespace, "kept", "new", "--wait=true")

    # --wait: until the release's objects are gone; then the post-delete hook's Job cleans
    # what the agents published, and Helm waits for it too.
    release.helm("uninstall", RELEASE, "--wait", "--timeout", "240s", timeout=300)
    release.uninstalled = True
    wait_for(lambda: not pods_of(kubectl, "app.kubernetes.io/part-of=fracgpu"), 120,
             lambda: release_state(kubectl))  # fmt: skip
    assert published_left(kubectl) == []
    left = release.left_on_node()
    assert left == [], f"left on the node after the upgrade and helm uninstall: {left}"
