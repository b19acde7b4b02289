"""Preparing and unpreparing claims on the node: limits, CDI specs and the checkpoint.

Prepare reads each claim from the API server (kubelet sends only its name and UID), takes this
driver's results, writes the claim's limits file (the hook's only source of truth) and its CDI
spec, records the claim in the checkpoint and answers with the CDI IDs. Unprepare removes all
three; a claim that is not prepared is not an error.

Both are serialised: one lock around every change of the prepared set and its files, and the
checkpoint is written before kubelet gets an answer (``checkpoint.save`` says why it is not
fsynced). The claim GETs of one call run concurrently, under the lock as kubelet's own plugin
helper does, so a stale retry never runs beside an Unprepare of its claim. The files themselves
are ``claimfiles.ClaimFiles``'s, the checkpoint's format ``checkpoint``'s.

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
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from core.kube import KubeError, KubeNotFound
from core.policy import SharePolicy
from deviceplugin.dra import checkpoint
from deviceplugin.dra.checkpoint import Prepared
from deviceplugin.dra.claimfiles import ClaimFiles
from deviceplugin.dra.claims import ClaimError, ClaimRef, Result, policy, results
from deviceplugin.dra.config import DraConfig
from deviceplugin.shared.checkpoint import CheckpointError
from deviceplugin.shared.guardowners import GrantError
from deviceplugin.shared.hostfiles import boot_id
from deviceplugin.shared.inventory import Card
from deviceplugin.shared.podresources import ContainerDevices
from deviceplugin.shared.uninstall import AgentFiles

log = logging.getLogger(__name__)

ClaimGetter = Callable[[ClaimRef], Awaitable[dict[str, Any]]]


@dataclass(frozen=True, slots=True)
class ClaimOutcome:
    """A claim's answer to kubelet: its devices, or the error that fails its pod's prepare."""

    prepared: Prepared | None
    error: str = ""


class DraDriver:
    def __init__(self, config: DraConfig, cards: Iterable[Card], get_claim: ClaimGetter) -> None:
        self.config = config
        self.cards = {c.index: c for c in cards}
        self._by_uuid = {c.uuid: c for c in self.cards.values()}
        self._get_claim = get_claim
        self.files = ClaimFiles(config)
        self._lock = asyncio.Lock()
        self.prepared: dict[str, Prepared] = {}
        self.checkpoint_writes = 0
        # Told each claim whose prepared results changed (none: unprepared); the claim status
        # writer (status.py) listens, off kubelet's path.
        self.on_change: Callable[[ClaimRef, tuple[Result, ...]], None] = lambda ref, res: None

    # ---- files -----------------------------------------------------------------------------

    def host_files(self) -> AgentFiles:
        """What this plugin writes on the node, which an uninstall removes (shared/uninstall)."""
        return self.files.agent_files()

    def install_host_files(self) -> None:
        self.files.install()

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
                return self.files.dirs(uid)[0]
        raise GrantError(f"ResourceClaim {namespace}/{name} is not prepared on this node")

    # ---- checkpoint ------------------------------------------------------------------------

    def _save(self) -> None:
        checkpoint.save(self.config.checkpoint_path, self.config.driver_name, self.prepared)
        self.checkpoint_writes += 1

    def _load(self) -> tuple[dict[str, Prepared], str]:
        return checkpoint.load(self.config.checkpoint_path, self._by_uuid)

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
                ids = self.files.write(entry.ref, list(entry.results))
            except (ClaimError, OSError) as exc:
                log.error(
                    "cannot restore a prepared claim",
                    extra={"claim": str(entry.ref), "error": str(exc)},
                )
                continue
            self.prepared[uid] = Prepared(entry.ref, entry.results, ids)
        self.files.remove_orphans(self.prepared)
        self._save()
        log.info("checkpoint restored", extra={"claims": len(self.prepared)})

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

    async def prepare(self, refs: list[ClaimRef]) -> dict[str, ClaimOutcome]:
        refs = list(dict.fromkeys(refs))  # a claim named twice is prepared once
        outcomes: dict[str, ClaimOutcome] = {}
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

    async def _prepare_one(self, ref: ClaimRef) -> tuple[ClaimOutcome, bool]:
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
                return ClaimOutcome(None, claim), True
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
                return ClaimOutcome(None, str(exc)), True
            fresh = True
        try:
            ids = await asyncio.to_thread(
                self.files.write, ref, granted, fresh=fresh, share_policy=share_policy
            )
        except ClaimError as exc:
            return ClaimOutcome(None, str(exc)), fresh
        except OSError as exc:
            return ClaimOutcome(
                None, f"{ref}: cannot write its limits or CDI spec on the node: {exc}"
            ), fresh
        if known is not None:
            return ClaimOutcome(known), False
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
        return ClaimOutcome(Prepared(ref, tuple(granted), ids)), True

    async def _save_or_undo(self, new: list[str], outcomes: dict[str, ClaimOutcome]) -> None:
        """Write the checkpoint; if that fails, the claims just prepared are not prepared (kubelet
        retries them), so that nothing is prepared that a restart would not know about."""
        try:
            await asyncio.to_thread(self._save)
        except OSError as exc:
            for uid in new:
                prepared = self.prepared.pop(uid)
                await asyncio.to_thread(self.files.remove, uid)
                error = f"{prepared.ref}: cannot write the checkpoint: {exc}"
                outcomes[uid] = ClaimOutcome(None, error)

    async def unprepare(self, refs: list[ClaimRef]) -> dict[str, str]:
        errors: dict[str, str] = {}
        async with self._lock:
            removed = await asyncio.gather(
                *(asyncio.to_thread(self.files.remove, r.uid) for r in refs),
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
