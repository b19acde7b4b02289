"""Preparing and unpreparing claims on the node: limits, CDI specs and the checkpoint.

Prepare reads each claim from the API server (kubelet sends only its name and UID), takes this
driver's results, writes the claim's limits file (the hook's only source of truth) and its CDI
spec, records the claim in the checkpoint and answers with the CDI IDs. Unprepare removes all
three; a claim that is not prepared is not an error.

Both are serialised: one lock around every change of the prepared set and its files, and the
checkpoint is written (durably) before kubelet gets an answer. The claim GETs of one call run
concurrently and outside the lock: an allocated claim never changes under its UID, so what they
read cannot go stale, and one slow GET does not hold up other pods' Unprepare.

Restarts (docs/dra.md has the cases):
- plugin restart: kubelet does not prepare running pods' claims again, so the checkpoint is the
  record; ``restore`` reloads it and writes every claim's limits and CDI spec again, which also
  repairs a CDI directory that a reboot emptied (it is usually a tmpfs);
- a claim deleted while the plugin was down: ``reconcile`` asks the API server for every
  prepared claim and drops those that are gone or were replaced under the same name;
- files that no checkpoint entry names (a crash between writing them and the checkpoint) are
  removed at start; kubelet got no answer for them and prepares the claim again.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import aiohttp
from pydantic import Field

from core.kube import KubeError, KubeNotFound
from core.policy import SharePolicy
from deviceplugin.dra import cdi
from deviceplugin.dra.claims import ClaimError, ClaimRef, Result, limits, policy, results
from deviceplugin.dra.config import DraConfig
from deviceplugin.shared import cdispec
from deviceplugin.shared import checkpoint as versioned
from deviceplugin.shared.checkpoint import CheckpointError
from deviceplugin.shared.guard import GrantError
from deviceplugin.shared.hostfiles import (
    DEVICE_PLUGIN_CHECKPOINT,
    boot_id,
    install_preload,
    make_grant_dirs,
    write_limits,
    write_policy,
)
from deviceplugin.shared.inventory import Card
from deviceplugin.shared.podresources import ContainerDevices
from deviceplugin.shared.uninstall import GRANT_DIRS, AgentFiles

log = logging.getLogger(__name__)

CHECKPOINT_VERSION = 1

ClaimGetter = Callable[[ClaimRef], Awaitable[dict[str, Any]]]


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


@dataclass(frozen=True, slots=True)
class Outcome:
    """A claim's answer to kubelet: its devices, or the error that fails its pod's prepare."""

    prepared: Prepared | None
    error: str = ""


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


class DraDriver:
    def __init__(self, config: DraConfig, cards: Iterable[Card], get_claim: ClaimGetter) -> None:
        self.config = config
        self.cards = {c.index: c for c in cards}
        self._by_uuid = {c.uuid: c for c in self.cards.values()}
        self._get_claim = get_claim
        self._lock = asyncio.Lock()
        self.prepared: dict[str, Prepared] = {}
        self.checkpoint_writes = 0
        # Told each claim whose prepared results changed (none: unprepared); the claim status
        # writer (status.py) listens, off kubelet's path.
        self.on_change: Callable[[ClaimRef, tuple[Result, ...]], None] = lambda ref, res: None

    # ---- files -----------------------------------------------------------------------------

    def _claim_dirs(self, uid: str) -> tuple[Path, Path]:
        base = self.config.claims_dir / uid
        return base / "limits", base / "shared"

    def _write_files(
        self,
        ref: ClaimRef,
        granted: list[Result],
        *,
        fresh: bool = False,
        share_policy: SharePolicy | None = None,
    ) -> tuple[str, ...]:
        """The claim's limits file and CDI spec; its CDI IDs.

        ``fresh``: a claim not prepared before, whose files are written without reading what
        is there (a prepare of eight claims is dominated by these few file operations on a
        slow disk). Otherwise they are rewritten only where they differ.
        """
        claim_limits = limits(ref, granted)
        limits_dir, shared_dir = self._claim_dirs(ref.uid)
        if fresh:
            limits_dir.parent.mkdir(exist_ok=True)
        make_grant_dirs(limits_dir, shared_dir)
        if share_policy is not None:  # read with the claim; a re-prepare keeps what was written
            write_policy(limits_dir.parent, share_policy)
        if write_limits(limits_dir, claim_limits, fresh=fresh):
            log.info(
                "limits written",
                extra={
                    "claim": f"{ref.namespace}/{ref.name}",
                    "uid": ref.uid,
                    "devices": list(claim_limits.devices),
                    "memory_bytes": claim_limits.memory_bytes,
                    "compute_percent": claim_limits.compute_percent,
                },
            )
        document = cdi.spec(
            driver=self.config.driver_name,
            claim_uid=ref.uid,
            granted=granted,
            limits_dir=limits_dir,
            shared_dir=shared_dir,
            hook_library=self.config.hook_library,
            ld_so_preload=self.config.ld_so_preload,
            dev_root=self.config.dev_root,
        )
        path = cdi.spec_path(self.config.cdi_root, self.config.driver_name, ref.uid)
        cdispec.write(path, document, fresh=fresh)
        return tuple(cdi.qualified(self.config.driver_name, ref.uid, r) for r in granted)

    def _remove_files(self, uid: str) -> None:
        cdi.spec_path(self.config.cdi_root, self.config.driver_name, uid).unlink(missing_ok=True)
        base = self.config.claims_dir / uid
        if base.exists():
            shutil.rmtree(base)

    def host_files(self) -> AgentFiles:
        """What this plugin writes on the node, which an uninstall removes (shared/uninstall)."""
        config = self.config
        return AgentFiles(
            host_root=config.host_root,
            grants=config.claims_dir,
            cdi_root=config.cdi_root,
            cdi_prefix=cdi.spec_path(Path(), config.driver_name, "").name.removesuffix(".json"),
            sockets=(config.registry_socket, config.service_socket),
            checkpoint=config.checkpoint_path,
            own_dir=config.plugin_dir,
            foreign=(
                *(
                    config.host_root / name
                    for name in GRANT_DIRS
                    if config.host_root / name != config.claims_dir
                ),
                config.host_root / DEVICE_PLUGIN_CHECKPOINT,
            ),
        )

    def install_host_files(self) -> None:
        install_preload(self.config.ld_so_preload)
        self.config.claims_dir.mkdir(parents=True, exist_ok=True)
        self.config.cdi_root.mkdir(parents=True, exist_ok=True)

    def grant_dir(self, container: ContainerDevices) -> Path:
        """The limits directory of the one claim of this driver a listed container uses (the
        guard's grant). Called from the guard's thread while the event loop changes the prepared
        claims: ``list(dict.items())`` copies them in one step under the interpreter lock (string
        keys run no Python code), so the copy is never half-changed."""
        if len(container.claims) != 1:
            raise GrantError(
                f"container {container.name} uses {len(container.claims)} claims of "
                f"{self.config.driver_name}; the guard checks containers with exactly one"
            )
        ((namespace, name),) = container.claims
        for uid, prepared in list(self.prepared.items()):
            if (prepared.ref.namespace, prepared.ref.name) == (namespace, name):
                return self._claim_dirs(uid)[0]
        raise GrantError(f"ResourceClaim {namespace}/{name} is not prepared on this node")

    # ---- checkpoint ------------------------------------------------------------------------

    def _save(self) -> None:
        # Not fsynced: the checkpoint must survive the plugin's restarts, which the page cache
        # does. A crash of the node loses at most the newest claims, or reads as corrupt and is
        # ignored; either way kubelet prepares every claim again when it re-creates the pod
        # sandboxes after the reboot, and the reconciler drops what is gone. Two fsyncs were the
        # slowest and most variable part of a prepare.
        versioned.write(
            self.config.checkpoint_path,
            DraCheckpoint(
                version=CHECKPOINT_VERSION,
                driver=self.config.driver_name,
                boot_id=boot_id(),
                claims={uid: p.record() for uid, p in sorted(self.prepared.items())},
            ),
            durable=False,
        )
        self.checkpoint_writes += 1

    def _load(self) -> tuple[dict[str, Prepared], str]:
        path = self.config.checkpoint_path
        document = versioned.read(path, DraCheckpoint)
        if document is None:
            return {}, ""
        loaded: dict[str, Prepared] = {}
        for uid, entry in document.claims.items():
            ref = ClaimRef(entry.namespace, entry.name, uid)
            granted, ids = [], []
            for device in entry.devices:
                card = self._by_uuid.get(device.uuid)
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

    def restore(self) -> None:
        """Reload the checkpoint, write every claim's files again, remove files of no claim."""
        try:
            loaded, recorded_boot = self._load()
        except CheckpointError as exc:
            log.error(
                "checkpoint ignored; kubelet re-prepares on new sandboxes",
                extra={"error": str(exc)},
            )
            loaded, recorded_boot = {}, ""
        if recorded_boot and recorded_boot != boot_id():
            log.info("the node rebooted since the checkpoint; rewriting CDI specs")
        self.prepared = {}
        for uid, entry in loaded.items():
            try:
                ids = self._write_files(entry.ref, list(entry.results))
            except (ClaimError, OSError) as exc:
                log.error(
                    "cannot restore a prepared claim",
                    extra={"claim": str(entry.ref), "error": str(exc)},
                )
                continue
            self.prepared[uid] = Prepared(entry.ref, entry.results, ids)
        self._collect_orphans()
        self._save()
        log.info("checkpoint restored", extra={"claims": len(self.prepared)})

    def _collect_orphans(self) -> None:
        for uid, path in cdi.specs(self.config.cdi_root, self.config.driver_name):
            if uid not in self.prepared:
                path.unlink(missing_ok=True)
                log.info("orphaned CDI spec removed", extra={"uid": uid})
        root = self.config.claims_dir
        if root.is_dir():
            for entry in root.iterdir():
                if entry.is_dir() and entry.name not in self.prepared:
                    shutil.rmtree(entry, ignore_errors=True)
                    log.info("orphaned claim directory removed", extra={"uid": entry.name})

    # ---- kubelet's calls -------------------------------------------------------------------

    async def _read(self, ref: ClaimRef) -> dict[str, Any]:
        try:
            async with asyncio.timeout(self.config.claim_timeout_s):
                return await self._get_claim(ref)
        except aiohttp.ServerDisconnectedError:
            # A pooled keep-alive connection the server had already closed: one fresh try.
            async with asyncio.timeout(self.config.claim_timeout_s):
                return await self._get_claim(ref)

    async def _fetch(self, ref: ClaimRef) -> dict[str, Any] | str:
        """The claim, or the error text for kubelet."""
        try:
            return await self._read(ref)
        except KubeNotFound:
            return f"{ref}: not found on the API server (deleted?)"
        except KubeError as exc:
            return f"{ref}: reading it from the API server failed: {exc}; kubelet retries"
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            return (
                f"{ref}: the API server did not answer ({type(exc).__name__}: {exc}); "
                "kubelet retries"
            )

    async def prepare(self, refs: list[ClaimRef]) -> dict[str, Outcome]:
        refs = list(dict.fromkeys(refs))  # a claim named twice is prepared once
        outcomes: dict[str, Outcome] = {}
        async with self._lock:
            # Each claim on its own: read (unless prepared before), check, write its files in a
            # worker thread; the claims of one call overlap, so eight claims cost little more
            # than the slowest one. The lock covers the reads too, as kubelet's own plugin
            # helper does: a stale retry then never runs beside an Unprepare of its claim.
            done = await asyncio.gather(*(self._prepare_one(r) for r in refs))
            new: list[str] = []
            for ref, (outcome, fresh) in zip(refs, done, strict=True):
                outcomes[ref.uid] = outcome
                if outcome.prepared is not None and fresh:
                    self.prepared[ref.uid] = outcome.prepared
                    new.append(ref.uid)
            if new:
                await self._save_or_undo(new, outcomes)
                for uid in new:
                    prepared = self.prepared.get(uid)
                    if prepared is not None:
                        self.on_change(prepared.ref, prepared.results)
        for uid, outcome in outcomes.items():
            if outcome.error:
                log.warning("prepare failed", extra={"uid": uid, "error": outcome.error})
        return outcomes

    async def _prepare_one(self, ref: ClaimRef) -> tuple[Outcome, bool]:
        """The claim's outcome, and whether it was prepared just now (not before)."""
        known = self.prepared.get(ref.uid)
        share_policy: SharePolicy | None = None
        if known is not None:
            # Already prepared (a retry, or the same claim in a new sandbox): the files are
            # written again in case a reboot or a person removed them.
            ref, granted, fresh = known.ref, list(known.results), False
        else:
            claim = await self._fetch(ref)
            if isinstance(claim, str):
                return Outcome(None, claim), True
            try:
                granted = results(
                    ref,
                    claim,
                    driver=self.config.driver_name,
                    pool=self.config.pool_name,
                    cards=self.cards,
                )
                share_policy = policy(ref, claim, driver=self.config.driver_name)
            except ClaimError as exc:
                return Outcome(None, str(exc)), True
            fresh = True
        try:
            ids = await asyncio.to_thread(
                self._write_files, ref, granted, fresh=fresh, share_policy=share_policy
            )
        except ClaimError as exc:
            return Outcome(None, str(exc)), fresh
        except OSError as exc:
            return Outcome(
                None, f"{ref}: cannot write its limits or CDI spec on the node: {exc}"
            ), fresh
        if known is not None:
            return Outcome(known), False
        log.info(
            "claim prepared",
            extra={
                "claim": f"{ref.namespace}/{ref.name}",
                "uid": ref.uid,
                "devices": [r.device for r in granted],
                "cores": granted[0].cores,
                "memory_bytes": granted[0].memory_bytes,
            },
        )
        return Outcome(Prepared(ref, tuple(granted), ids)), True

    async def _save_or_undo(self, new: list[str], outcomes: dict[str, Outcome]) -> None:
        """Write the checkpoint; if that fails, the claims just prepared are not prepared (kubelet
        retries them), so that nothing is prepared that a restart would not know about."""
        try:
            await asyncio.to_thread(self._save)
        except OSError as exc:
            for uid in new:
                prepared = self.prepared.pop(uid)
                await asyncio.to_thread(self._remove_files, uid)
                outcomes[uid] = Outcome(None, f"{prepared.ref}: cannot write the checkpoint: {exc}")

    async def unprepare(self, refs: list[ClaimRef]) -> dict[str, str]:
        errors: dict[str, str] = {}
        async with self._lock:
            removed = await asyncio.gather(
                *(asyncio.to_thread(self._remove_files, r.uid) for r in refs),
                return_exceptions=True,
            )
            changed = False
            for ref, outcome in zip(refs, removed, strict=True):
                if isinstance(outcome, OSError):
                    errors[ref.uid] = f"{ref}: cannot remove its files on the node: {outcome}"
                    continue
                if isinstance(outcome, BaseException):
                    raise outcome
                errors[ref.uid] = ""
                if self.prepared.pop(ref.uid, None) is not None:
                    changed = True
                    self.on_change(ref, ())
                    log.info(
                        "claim unprepared",
                        extra={"claim": f"{ref.namespace}/{ref.name}", "uid": ref.uid},
                    )
            if changed:
                try:
                    await asyncio.to_thread(self._save)
                except OSError as exc:
                    for uid, error in list(errors.items()):
                        errors[uid] = error or f"cannot write the checkpoint: {exc}"
        return errors

    async def reconcile(self) -> list[str]:
        """Drop prepared claims that the API server no longer has (deleted while we were down,
        or replaced under the same name); the UIDs dropped."""
        stale: list[ClaimRef] = []
        for prepared in list(self.prepared.values()):
            try:
                claim = await self._read(prepared.ref)
            except KubeNotFound:
                stale.append(prepared.ref)
                continue
            except (KubeError, aiohttp.ClientError, OSError, TimeoutError) as exc:
                log.warning(
                    "claim check skipped", extra={"claim": str(prepared.ref), "error": str(exc)}
                )
                continue
            if (claim.get("metadata") or {}).get("uid") != prepared.ref.uid:
                stale.append(prepared.ref)
        if stale:
            await self.unprepare(stale)
            log.info(
                "claims gone from the API server dropped", extra={"uids": [r.uid for r in stale]}
            )
        return [r.uid for r in stale]
