"""Recovery and reconciliation passes (recovery.Recovery) over a real allocator and host files,
with kubelet's PodResources listing as a plain list."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest

from core import contract
from deviceplugin.classic import checkpoint
from deviceplugin.classic.allocation import container_dir_name
from deviceplugin.classic.allocator import Allocator
from deviceplugin.classic.config import Config
from deviceplugin.classic.containerfiles import ContainerFiles, container_dirs
from deviceplugin.classic.ids import core_id, memory_id
from deviceplugin.classic.recovery import Recovery
from deviceplugin.shared.inventory import Card
from deviceplugin.shared.podresources import ContainerDevices, PodResourcesError

CARDS = {i: Card(i, f"GPU-{i}", "Fake", 1024, i, None) for i in range(2)}
CORE = frozenset(core_id(0, i) for i in range(30))
MEMORY = frozenset({memory_id(0, 0)})


class Kubelet:
    """The PodResources listing, and the saves the plugin asked for."""

    def __init__(self) -> None:
        self.containers: list[ContainerDevices] = []
        self.down = False
        self.saves = 0

    def list(self) -> list[ContainerDevices]:
        if self.down:
            raise PodResourcesError("unavailable")
        return list(self.containers)

    def save(self) -> None:
        self.saves += 1


def socket(tmp_path: Path) -> Path:
    path = tmp_path / "kubelet.sock"
    path.touch()
    return path


def setup(tmp_path: Path, *, settled: bool = True) -> tuple[Recovery, Allocator, Kubelet, Config]:
    config = Config(
        host_root=tmp_path / "host",
        cdi_root=None,
        # settled: kubelet made its socket (it is not older than the test, and need not be)
        podresources_socket=socket(tmp_path) if settled else tmp_path / "missing.sock",
        kubelet_settle_s=0.0,
        reconcile_confirm_s=0.0,
        reconcile_grace_s=0.0,
    )
    allocator = Allocator(CARDS.values(), settle_s=0.0)
    kubelet = Kubelet()
    recovery = Recovery(
        config,
        allocator,
        ContainerFiles(config, CARDS),
        list_containers=kubelet.list,
        save=kubelet.save,
    )
    return recovery, allocator, kubelet, config


def running(config: Config) -> ContainerDevices:
    return ContainerDevices(
        "ns", "pod", "app", {config.core_resource: CORE, config.memory_resource: MEMORY}
    )


SETTLED = [  # (the socket exists, seconds since it was made, settled after 30 s)
    pytest.param(False, 60.0, False, id="no socket"),
    pytest.param(True, 1.0, False, id="kubelet just started"),
    pytest.param(True, 60.0, True, id="settled"),
]


@pytest.mark.parametrize(("exists", "after", "settled"), SETTLED)
def test_kubelet_settled(tmp_path: Path, exists: bool, after: float, settled: bool) -> None:
    recovery, _, _, config = setup(tmp_path, settled=exists)
    object.__setattr__(config, "kubelet_settle_s", 30.0)
    assert recovery._kubelet_settled(time.time() + after) is settled


def test_a_pass_adopts_writes_the_limits_and_saves_once(tmp_path: Path) -> None:
    recovery, allocator, kubelet, config = setup(tmp_path)
    kubelet.containers = [running(config)]
    assert not recovery.reconciled
    result = recovery.reconcile_once()
    assert recovery.reconciled
    (adopted,) = result.adopted
    assert adopted.verified and adopted.cards
    limits_dir, _ = container_dirs(config, CORE)
    assert (limits_dir / contract.LIMITS_FILE).exists()
    assert kubelet.saves == 1
    recovery.reconcile_once()  # nothing changed: nothing written
    assert kubelet.saves == 1
    kubelet.containers = []
    assert [a.key for a in recovery.reconcile_once().freed] == [adopted.key]
    assert not allocator.allocations()
    assert kubelet.saves == 2


def test_an_unsettled_kubelet_frees_nothing_and_collects_nothing(tmp_path: Path) -> None:
    recovery, allocator, _, config = setup(tmp_path, settled=False)
    stale = config.containers_dir / "c-stale"
    stale.mkdir(parents=True)
    allocator.adopt(sorted(CORE), sorted(MEMORY))
    recovery.reconcile_once()
    assert allocator.allocations()
    assert stale.exists()


def test_a_settled_pass_collects_stale_directories(tmp_path: Path) -> None:
    recovery, _, kubelet, config = setup(tmp_path)
    stale = config.containers_dir / "c-stale"
    stale.mkdir(parents=True)
    os.utime(stale, (0, 0))
    kubelet.containers = [running(config)]
    recovery.reconcile_once()
    assert not stale.exists()
    assert (config.containers_dir / container_dir_name(CORE)).exists()


RECOVER = [  # (checkpoint file: None, "bad" or "good"; kubelet down; allocations after)
    pytest.param(None, False, 0, id="nothing to recover"),
    pytest.param("bad", False, 0, id="a bad checkpoint is ignored"),
    pytest.param("good", True, 1, id="the checkpoint, kubelet down"),
    pytest.param("good", False, 0, id="the checkpoint, then kubelet: it ended"),
]


@pytest.mark.parametrize(("document", "down", "after"), RECOVER)
def test_recover(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, document: str | None, down: bool, after: int
) -> None:
    recovery, allocator, kubelet, config = setup(tmp_path)
    config.checkpoint_path.parent.mkdir(parents=True)
    if document == "bad":
        config.checkpoint_path.write_text("{")
    elif document == "good":
        other = Allocator(CARDS.values())
        other.adopt(sorted(CORE), sorted(MEMORY))
        checkpoint.write(config.checkpoint_path, CARDS.values(), other.allocations())
    kubelet.down = down
    caplog.set_level(logging.INFO, logger="deviceplugin.classic.plugin")
    recovery.recover()
    assert len(allocator.allocations()) == after
    messages = [r.getMessage() for r in caplog.records]
    assert "checkpoint restored" in messages
    assert ("checkpoint ignored" in messages) is (document == "bad")
    assert ("PodResources unavailable at start" in messages) is down
    assert recovery.reconciled is not down
