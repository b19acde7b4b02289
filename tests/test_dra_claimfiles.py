"""The DRA plugin's per-claim files and its checkpoint, each on its own (driver.py uses both)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deviceplugin.dra import checkpoint
from deviceplugin.dra.checkpoint import Prepared
from deviceplugin.dra.claimfiles import ClaimFiles
from deviceplugin.dra.claims import ClaimRef, Result
from deviceplugin.dra.config import DraConfig
from deviceplugin.shared.checkpoint import CheckpointError
from deviceplugin.shared.inventory import Card

CARD = Card(0, "GPU-0a1b", "NVIDIA H100 80GB HBM3", 81559, 0, None)
REF = ClaimRef("team-a", "nb", "uid-1")
SHARE = Result("gpu", "node-a", "gpu-0", "s-1", CARD, 30, 8 * 2**30)


def files(tmp_path: Path) -> ClaimFiles:
    config = DraConfig(
        node_name="node-a", kubelet_root=tmp_path / "kl", cdi_root=tmp_path / "cdi",
        host_root=tmp_path / "host",
    )  # fmt: skip
    claim_files = ClaimFiles(config)
    claim_files.install()
    return claim_files


@pytest.mark.parametrize("fresh", [pytest.param(True, id="fresh"), pytest.param(False, id="again")])
def test_write_makes_limits_accounting_and_a_cdi_spec(tmp_path: Path, fresh: bool) -> None:
    claim_files = files(tmp_path)
    ids = claim_files.write(REF, [SHARE], fresh=fresh)
    limits_dir, shared_dir = claim_files.dirs(REF.uid)
    assert (limits_dir / "limits").is_file()
    assert shared_dir.is_dir()
    specs = list((tmp_path / "cdi").iterdir())
    assert len(specs) == 1 and REF.uid in specs[0].name
    assert len(ids) == 1 and REF.uid in ids[0]
    assert claim_files.write(REF, [SHARE]) == ids  # the same claim, the same IDs


def test_remove_leaves_nothing_of_the_claim(tmp_path: Path) -> None:
    claim_files = files(tmp_path)
    claim_files.write(REF, [SHARE], fresh=True)
    claim_files.remove(REF.uid)
    claim_files.remove(REF.uid)  # removing twice is no error: kubelet retries
    assert not (tmp_path / "host" / "claims" / REF.uid).exists()
    assert not list((tmp_path / "cdi").iterdir())


@pytest.mark.parametrize(
    ("prepared", "kept"),
    [
        pytest.param({"uid-1"}, {"uid-1"}, id="prepared-claims-kept"),
        pytest.param(set(), set(), id="files-of-no-claim-removed"),
    ],
)
def test_remove_orphans(tmp_path: Path, prepared: set[str], kept: set[str]) -> None:
    claim_files = files(tmp_path)
    claim_files.write(REF, [SHARE], fresh=True)
    claim_files.remove_orphans(prepared)
    assert {p.name for p in (tmp_path / "host" / "claims").iterdir()} == kept
    assert len(list((tmp_path / "cdi").iterdir())) == len(kept)


def test_agent_files_name_this_plugins_own(tmp_path: Path) -> None:
    agent = files(tmp_path).agent_files()
    assert agent.grants == tmp_path / "host" / "claims"
    assert agent.checkpoint == tmp_path / "kl" / "plugins" / "gpu.fracgpu.io" / "checkpoint.json"
    assert tmp_path / "host" / "containers" in agent.foreign  # the device plugin's, not ours


def test_checkpoint_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.json"
    prepared = {REF.uid: Prepared(REF, (SHARE,), ("gpu.fracgpu.io/x=y",))}
    checkpoint.save(path, "gpu.fracgpu.io", prepared)
    loaded, boot = checkpoint.load(path, {CARD.uuid: CARD})
    assert boot  # the boot it was written in
    assert loaded == prepared
    assert json.loads(path.read_text())["version"] == checkpoint.VERSION


@pytest.mark.parametrize(
    ("cards", "error"),
    [
        pytest.param({}, "no longer has", id="a-card-the-node-lost"),
    ],
)
def test_checkpoint_refuses(tmp_path: Path, cards: dict[str, Card], error: str) -> None:
    path = tmp_path / "checkpoint.json"
    checkpoint.save(path, "gpu.fracgpu.io", {REF.uid: Prepared(REF, (SHARE,), ("x",))})
    with pytest.raises(CheckpointError, match=error):
        checkpoint.load(path, cards)


def test_no_checkpoint_is_nothing_prepared(tmp_path: Path) -> None:
    assert checkpoint.load(tmp_path / "absent.json", {}) == ({}, "")
