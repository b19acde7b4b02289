"""What the DRA plugin writes on the node for each prepared claim: its limits file (the hook's
only source of truth), its share policy, its accounting directory and its CDI spec.

Layout (``host_root`` is ``/var/lib/fracgpu`` by default)::

    <host_root>/claims/<claim uid>/limits/limits   the claim's limits; mounted read-only
    <host_root>/claims/<claim uid>/shared/         the hook's accounting; read-write
    <cdi_root>/<vendor>-<class>_<claim uid>.json    its CDI spec

Plain file operations with no lock of their own: the driver (``driver.py``) serialises every
change of the prepared set, and calls these from worker threads.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Collection
from pathlib import Path

from core.policy import SharePolicy
from deviceplugin.dra import cdi
from deviceplugin.dra.claims import ClaimRef, Result, limits
from deviceplugin.dra.config import DraConfig
from deviceplugin.shared import cdispec
from deviceplugin.shared.hostfiles import (
    DEVICE_PLUGIN_CHECKPOINT,
    install_preload,
    make_grant_dirs,
    write_limits,
    write_policy,
)
from deviceplugin.shared.uninstall import GRANT_DIRS, AgentFiles

log = logging.getLogger(__name__)


class ClaimFiles:
    def __init__(self, config: DraConfig) -> None:
        self.config = config

    def dirs(self, uid: str) -> tuple[Path, Path]:
        """The claim's limits directory (read-only in containers) and accounting directory."""
        base = self.config.claims_dir / uid
        return base / "limits", base / "shared"

    def write(
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
        config = self.config
        claim_limits = limits(ref, granted)
        limits_dir, shared_dir = self.dirs(ref.uid)
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
            driver=config.driver_name,
            claim_uid=ref.uid,
            granted=granted,
            limits_dir=limits_dir,
            shared_dir=shared_dir,
            hook_library=config.hook_library,
            ld_so_preload=config.ld_so_preload,
            dev_root=config.dev_root,
        )
        path = cdi.spec_path(config.cdi_root, config.driver_name, ref.uid)
        cdispec.write(path, document, fresh=fresh)
        return tuple(cdi.qualified(config.driver_name, ref.uid, r) for r in granted)

    def remove(self, uid: str) -> None:
        cdi.spec_path(self.config.cdi_root, self.config.driver_name, uid).unlink(missing_ok=True)
        base = self.config.claims_dir / uid
        if base.exists():
            shutil.rmtree(base)

    def remove_orphans(self, prepared: Collection[str]) -> None:
        """Files that no prepared claim names: a crash between writing them and the checkpoint
        (kubelet got no answer for them and prepares the claim again)."""
        for uid, path in cdi.specs(self.config.cdi_root, self.config.driver_name):
            if uid not in prepared:
                path.unlink(missing_ok=True)
                log.info("orphaned CDI spec removed", extra={"uid": uid})
        root = self.config.claims_dir
        if root.is_dir():
            for entry in root.iterdir():
                if entry.is_dir() and entry.name not in prepared:
                    shutil.rmtree(entry, ignore_errors=True)
                    log.info("orphaned claim directory removed", extra={"uid": entry.name})

    def install(self) -> None:
        """The hook's preload file and the directories every claim's files go in."""
        install_preload(self.config.ld_so_preload)
        self.config.claims_dir.mkdir(parents=True, exist_ok=True)
        self.config.cdi_root.mkdir(parents=True, exist_ok=True)

    def agent_files(self) -> AgentFiles:
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


__all__ = ["ClaimFiles"]
