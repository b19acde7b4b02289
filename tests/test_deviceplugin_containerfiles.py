"""A container's files on the host (containerfiles): names, the limits file, the CDI spec, and
the collection of directories no allocation names."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from core import contract
from core.units import ENV_MEMORY_MIB
from deviceplugin.classic.allocation import Allocation, container_dir_name
from deviceplugin.classic.config import Config
from deviceplugin.classic.containerfiles import (
    CDI_KIND,
    ContainerFiles,
    cdi_spec,
    cdi_spec_path,
    container_dirs,
)
from deviceplugin.classic.ids import core_id, memory_id
from deviceplugin.classic.prestart import PreStartError
from deviceplugin.shared.guardowners import GrantError
from deviceplugin.shared.inventory import Card
from deviceplugin.shared.podresources import ContainerDevices

CARDS = {i: Card(i, f"GPU-{i}", "Fake", 1024, 10 + i, None) for i in range(2)}
CORE_IDS = tuple(core_id(0, i) for i in range(30))


def config(tmp_path: Path, *, cdi: bool = True, **kw: object) -> Config:
    return Config(
        host_root=tmp_path / "host",
        dev_root=Path("/dev"),
        cdi_root=tmp_path / "cdi" if cdi else None,
        **kw,  # type: ignore[arg-type]
    )


def placed(core: int = 30, memory: int = 2, cards: tuple[int, ...] = (1,)) -> Allocation:
    return Allocation(
        core=tuple(core_id(0, i) for i in range(core)),
        memory=tuple(memory_id(0, i) for i in range(memory)),
        cards=cards,
        created=0.0,
    )


def listed(core: tuple[str, ...] = CORE_IDS) -> ContainerDevices:
    conf = Config()
    return ContainerDevices("ns", "pod", "app", {conf.core_resource: frozenset(core)})


def test_names() -> None:
    assert cdi_spec_path(Path("/cdi"), "c-1") == Path("/cdi/fracgpu.io-container_c-1.json")
    limits, shared = container_dirs(Config(host_root=Path("/h")), CORE_IDS)
    assert limits == Path(f"/h/containers/{container_dir_name(CORE_IDS)}/limits")
    assert shared == limits.parent / "shared"


CDI = [  # (allocation, device nodes, whether the memory variable is set)
    pytest.param(placed(cards=(1,)), ["/dev/nvidia11"], False, id="a share"),
    pytest.param(placed(100, 0, (0,)), ["/dev/nvidia10"], True, id="a whole card"),
    pytest.param(
        placed(200, 0, (0, 1)), ["/dev/nvidia10", "/dev/nvidia11"], True, id="two whole cards"
    ),
]


@pytest.mark.parametrize(("allocation", "nodes", "env"), CDI)
def test_cdi_spec(allocation: Allocation, nodes: list[str], env: bool) -> None:
    spec = cdi_spec(Config(), CARDS, allocation)
    assert spec["kind"] == CDI_KIND
    (device,) = spec["devices"]  # type: ignore[misc]
    assert device["name"] == container_dir_name(allocation.core)
    edits = device["containerEdits"]
    assert [n["path"] for n in edits["deviceNodes"]] == nodes
    assert [m["containerPath"].rsplit("/", 1)[1] for m in edits["mounts"]] == [
        CARDS[i].uuid for i in allocation.cards
    ]
    assert edits.get("env") == ([f"{ENV_MEMORY_MIB}=1024"] if env else None)


@pytest.mark.parametrize(
    "cdi", [pytest.param(True, id="with CDI"), pytest.param(False, id="without")]
)
def test_write_and_read_back(tmp_path: Path, cdi: bool) -> None:
    conf = config(tmp_path, cdi=cdi)
    files = ContainerFiles(conf, CARDS)
    allocation = placed()
    path = files.write(listed(), allocation)
    limits = contract.Limits.parse(path.read_text(encoding="ascii"))
    assert limits.devices == (CARDS[1].uuid,)
    assert files.cards_of(allocation.core) == (1,)
    spec = cdi_spec_path(tmp_path / "cdi", container_dir_name(allocation.core))
    assert spec.exists() is cdi
    if cdi:
        assert json.loads(spec.read_text())["kind"] == CDI_KIND


def test_write_refuses_a_share_without_memory(tmp_path: Path) -> None:
    with pytest.raises(PreStartError, match="holds no"):
        ContainerFiles(config(tmp_path), CARDS).write(None, placed(memory=0))


CARDS_OF = [  # (limits file text or None: no file, the cards)
    pytest.param(None, None, id="no file"),
    pytest.param("not limits", None, id="unreadable"),
    pytest.param(contract.Limits(("GPU-1",), 2**28, 30).render(), (1,), id="its card"),
    pytest.param(
        contract.Limits(("GPU-9",), 2**28, 30).render(), None, id="a card this node lacks"
    ),
]


@pytest.mark.parametrize(("text", "cards"), CARDS_OF)
def test_cards_of(tmp_path: Path, text: str | None, cards: tuple[int, ...] | None) -> None:
    conf = config(tmp_path)
    if text is not None:
        limits_dir, _ = container_dirs(conf, CORE_IDS)
        limits_dir.mkdir(parents=True)
        (limits_dir / contract.LIMITS_FILE).write_text(text)
    assert ContainerFiles(conf, CARDS).cards_of(CORE_IDS) == cards


def test_grant_dir(tmp_path: Path) -> None:
    conf = config(tmp_path)
    files = ContainerFiles(conf, CARDS)
    assert files.grant_dir(listed()) == container_dirs(conf, CORE_IDS)[0]
    with pytest.raises(GrantError, match="holds no"):
        files.grant_dir(listed(()))


COLLECT = [  # (directory, named by an allocation, age in s, collections, removed at the last)
    pytest.param(("c-live", True, 100.0, 2, False), id="named: kept"),
    pytest.param(("c-gone", False, 100.0, 1, False), id="unnamed once: kept"),
    pytest.param(("c-gone", False, 100.0, 2, True), id="unnamed twice: removed"),
    pytest.param(("c-young", False, 0.0, 2, False), id="younger than the grace: kept"),
    pytest.param(("other", False, 100.0, 2, False), id="not a container directory: kept"),
]
CONFIRM_S = 0.05


@pytest.mark.parametrize("case", COLLECT)
def test_collect(tmp_path: Path, case: tuple[str, bool, float, int, bool]) -> None:
    name, live, age, passes, removed = case
    conf = config(tmp_path, reconcile_confirm_s=CONFIRM_S, reconcile_grace_s=10.0)
    entry = conf.containers_dir / name
    entry.mkdir(parents=True)
    then = time.time() - age
    os.utime(entry, (then, then))
    spec = cdi_spec_path(tmp_path / "cdi", name)
    spec.parent.mkdir()
    spec.write_text("{}")
    files = ContainerFiles(conf, CARDS)
    names: set[str | None] = {name} if live else set()
    result: list[str] = []
    for n in range(passes):
        if n:
            time.sleep(CONFIRM_S)
        result = files.collect(names)
    assert (result == [name]) is removed
    assert entry.exists() is not removed
    assert spec.exists() is not removed
    assert files.young is (name == "c-young" or (name == "c-gone" and not removed))


def test_collect_without_a_containers_directory(tmp_path: Path) -> None:
    assert ContainerFiles(config(tmp_path), CARDS).collect(set()) == []
