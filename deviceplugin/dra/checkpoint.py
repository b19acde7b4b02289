"""The DRA plugin's checkpoint: the claims it prepared, by claim UID, so that a restarted
plugin knows what kubelet will not prepare again.

Versioned through ``shared.checkpoint`` (``version`` 1 is the first). Cards are recorded by UUID:
after a change of hardware an index may name another card, and a claim on a card the node no
longer has makes the whole checkpoint unreadable (kubelet then prepares every claim again on new
sandboxes).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import Field

from deviceplugin.dra.claims import ClaimRef, Result
from deviceplugin.shared import checkpoint as versioned
from deviceplugin.shared.checkpoint import CheckpointError
from deviceplugin.shared.hostfiles import boot_id
from deviceplugin.shared.inventory import Card

VERSION = 1


@dataclass(frozen=True, slots=True)
class Prepared:
    ref: ClaimRef
    results: tuple[Result, ...]
    cdi_ids: tuple[str, ...]  # one per result, in order

    def record(self) -> CheckpointClaim:
        return CheckpointClaim(
            namespace=self.ref.namespace,
            name=self.ref.name,
            devices=[
                CheckpointDevice.model_validate({**r.to_json(), "cdiID": cdi_id})
                for r, cdi_id in zip(self.results, self.cdi_ids, strict=True)
            ],
        )


class CheckpointDevice(versioned.Document):
    """One prepared device of a claim, as the checkpoint records it."""

    request: str
    pool: str
    device: str
    share_id: str | None = Field(alias="shareID")
    uuid: str  # the card, by UUID: an index may name another card after a change of hardware
    cores: int
    memory_bytes: int = Field(alias="memoryBytes")
    cdi_id: str = Field(alias="cdiID")


class CheckpointClaim(versioned.Document):
    namespace: str
    name: str
    devices: list[CheckpointDevice]


class DraCheckpoint(versioned.Document):
    """Version 1, the first: the claims this plugin prepared, by claim UID."""

    version: Literal[1]
    driver: str
    boot_id: str = Field(alias="bootID")  # the boot it was written in ("" unknown)
    claims: dict[str, CheckpointClaim]


def save(path: Path, driver: str, prepared: Mapping[str, Prepared]) -> None:
    """Write ``prepared`` as the checkpoint at ``path``.

    Not fsynced: the checkpoint must survive the plugin's restarts, which the page cache does. A
    crash of the node loses at most the newest claims, or reads as corrupt and is ignored;
    either way kubelet prepares every claim again when it re-creates the pod sandboxes after the
    reboot, and the reconciler drops what is gone. Two fsyncs were the slowest and most variable
    part of a prepare.
    """
    versioned.write(
        path,
        DraCheckpoint(
            version=VERSION,
            driver=driver,
            boot_id=boot_id(),
            claims={uid: p.record() for uid, p in sorted(prepared.items())},
        ),
        durable=False,
    )


def load(path: Path, by_uuid: Mapping[str, Card]) -> tuple[dict[str, Prepared], str]:
    """The prepared claims and the boot they were written in ("" unknown); none when there is
    no checkpoint. ``CheckpointError`` when it cannot be read or names a card not on the node."""
    document = versioned.read(path, DraCheckpoint)
    if document is None:
        return {}, ""
    loaded: dict[str, Prepared] = {}
    for uid, entry in document.claims.items():
        ref = ClaimRef(entry.namespace, entry.name, uid)
        granted, ids = [], []
        for device in entry.devices:
            card = by_uuid.get(device.uuid)
            if card is None:
                raise CheckpointError(
                    f"checkpoint {path}: {ref} holds card {device.uuid}, which this "
                    "node no longer has"
                )
            granted.append(
                Result(
                    request=device.request,
                    pool=device.pool,
                    device=device.device,
                    share_id=device.share_id,
                    card=card,
                    cores=device.cores,
                    memory_bytes=device.memory_bytes,
                )
            )
            ids.append(device.cdi_id)
        loaded[uid] = Prepared(ref, tuple(granted), tuple(ids))
    return loaded, document.boot_id


__all__ = [
    "VERSION",
    "CheckpointClaim",
    "CheckpointDevice",
    "DraCheckpoint",
    "Prepared",
    "load",
    "save",
]
