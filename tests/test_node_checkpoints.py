"""Both agents' checkpoints as typed, versioned documents: files written by the code before the
models (``tests/data/checkpoints``, made by that code, only pretty-printed) still read, an older
version is upgraded, and a file of another shape is refused with a message that says where."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from deviceplugin.classic import checkpoint as classic
from deviceplugin.dra.checkpoint import DraCheckpoint
from deviceplugin.dra.claims import ClaimRef, Result
from deviceplugin.dra.config import DraConfig
from deviceplugin.dra.driver import DraDriver
from deviceplugin.shared import checkpoint as versioned
from deviceplugin.shared.inventory import Card

DATA = Path(__file__).parent / "data" / "checkpoints"
CARDS = [
    Card(0, "GPU-0a1b", "NVIDIA H100 80GB HBM3", 81559, 0, None),
    Card(1, "GPU-1c2d", "NVIDIA H100 80GB HBM3", 81559, 1, None),
]


def test_yesterdays_device_plugin_checkpoint_reads() -> None:
    allocations = classic.read(DATA / "device-plugin-v2.json", {c.index: c for c in CARDS})
    assert [(a.key, len(a.core), len(a.memory), a.cards, a.verified) for a in allocations] == [
        ("k-share", 3, 2, (0,), True),
        ("k-whole", 100, 0, (1,), False),
        ("k-waiting", 2, 1, (), False),  # placed nowhere yet: waiting for a card
    ]


def test_a_version_1_device_plugin_checkpoint_is_upgraded(tmp_path: Path) -> None:
    document = json.loads((DATA / "device-plugin-v2.json").read_text())
    path = tmp_path / "checkpoint.json"
    path.write_text(json.dumps({**document, "version": 1}))
    before = classic.read(DATA / "device-plugin-v2.json", {c.index: c for c in CARDS})
    assert classic.read(path, {c.index: c for c in CARDS}) == before
    classic.write(path, CARDS, before)  # and it is written back as the current version
    assert json.loads(path.read_text())["version"] == classic.VERSION == 2


def _driver(tmp_path: Path) -> DraDriver:
    config = DraConfig(
        node_name="node-a", kubelet_root=tmp_path, cdi_root=tmp_path / "cdi", host_root=tmp_path
    )

    async def no_claims(ref: ClaimRef) -> dict[str, Any]:
        raise AssertionError("a load reads no claim")

    return DraDriver(config, CARDS, no_claims)


def test_yesterdays_dra_checkpoint_reads_and_writes_back_the_same(tmp_path: Path) -> None:
    driver = _driver(tmp_path)
    driver.config.plugin_dir.mkdir(parents=True)
    shutil.copy(DATA / "dra-plugin-v1.json", driver.config.checkpoint_path)
    loaded, boot = driver._load()
    assert boot == "0b7d5c1e-3f2a-4e8b-9c6d-1a2b3c4d5e6f"
    share = loaded["11111111-2222-3333-4444-555555555555"]
    assert share.ref == ClaimRef("team-a", "nb-gpu-x7k2q", "11111111-2222-3333-4444-555555555555")
    assert share.results == (
        Result("gpu", "node-a", "gpu-0", "3a6b1c2d-0000-4000-8000-000000000001", CARDS[0], 30,
               8 * 2**30),
    )  # fmt: skip
    whole = loaded["66666666-7777-8888-9999-000000000000"]
    assert (whole.results[0].card, whole.results[0].share_id) == (CARDS[1], None)
    driver.prepared = loaded
    driver._save()
    written = json.loads(driver.config.checkpoint_path.read_text())
    original = json.loads((DATA / "dra-plugin-v1.json").read_text())
    assert written["claims"] == original["claims"]
    assert (written["version"], written["driver"]) == (1, "gpu.fracgpu.io")


@pytest.mark.parametrize(
    ("agent", "change", "says"),
    [
        pytest.param("device-plugin", {"version": 9}, "version 9", id="dp-unknown-version"),
        pytest.param("device-plugin", {"owner": "x"}, "owner", id="dp-unknown-field"),
        pytest.param("device-plugin", {"cards": ["GPU-0a1b"]}, "cards", id="dp-cards-not-a-map"),
        pytest.param("dra-plugin", {"version": 2}, "version 2", id="dra-unknown-version"),
        pytest.param("dra-plugin", {"bootID": None}, "bootID", id="dra-boot-id-null"),
        pytest.param("dra-plugin", {"claims": {"u": {"namespace": "a", "name": "b"}}},
                     "claims.u.devices", id="dra-claim-without-devices"),
    ],
)  # fmt: skip
def test_a_checkpoint_of_another_shape_is_refused(
    agent: str, change: dict[str, Any], says: str, tmp_path: Path
) -> None:
    source = DATA / ("device-plugin-v2.json" if agent == "device-plugin" else "dra-plugin-v1.json")
    path = tmp_path / "checkpoint.json"
    path.write_text(json.dumps({**json.loads(source.read_text()), **change}))
    model: type[versioned.Document] = (
        classic.DevicePluginCheckpoint if agent == "device-plugin" else DraCheckpoint
    )
    with pytest.raises(versioned.CheckpointError, match=says):
        versioned.read(path, model, upgrades=classic.UPGRADES if agent == "device-plugin" else {})


def test_an_upgrade_chain_runs_in_order(tmp_path: Path) -> None:
    class Three(versioned.Document):
        version: int
        trail: list[int]

    path = tmp_path / "c.json"
    path.write_text(json.dumps({"version": 1, "trail": []}))
    upgrades = {v: (lambda d, v=v: {"version": v + 1, "trail": [*d["trail"], v]}) for v in (1, 2)}
    assert versioned.read(path, Three, upgrades=upgrades) == Three(version=3, trail=[1, 2])
