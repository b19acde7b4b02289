"""What a stopping node agent removes from its node when the release is uninstalled.

An agent gets SIGTERM when its pod is merely replaced (a rolling update, a deleted pod, a
drained node) and when the release is uninstalled; only then may it remove what it wrote on the
host. It tells the two apart by its own DaemonSet (``--daemonset``): gone, or being deleted,
means uninstalled. A restart changes nothing on the host.

The DaemonSet is watched for the agent's whole life, and asked again at the stop. The watch is
what makes ``helm uninstall`` work: Helm deletes the DaemonSet first and the agent's
RoleBinding and ServiceAccount right after, so by the time the garbage collector deletes the pod
its token is refused and a question asked only then goes unanswered; the watch saw the deletion
before that. Nothing is removed on a guess: when the API server cannot be asked and the watch has
not seen the DaemonSet go, or never saw it exist (a wrong ``--daemonset``), the agent leaves
everything as it is.

Uninstalled, the agent removes its sockets, and the directories and CDI specs of its shares that
no longer run. A share still running keeps its files (its container reads the limits file and
keeps its accounting there; a restart of it needs its CDI spec), and then so do the agent's
checkpoint (a reinstalled agent finds the share in it) and the hook. The hook files, and the host
root, go when no share of either mode is left and no other node agent's DaemonSet exists (a
``helm upgrade`` that switches modes deletes one agent's DaemonSet and creates the other's, which
mounts the same hook).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import shutil
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from core.informer import Informer, InformerSettings
from core.kube import DAEMONSETS, Api, KubeError, KubeNotFound, RawBody, call_json, kube_client
from deviceplugin.shared.hostfiles import hook_library, ld_so_preload
from deviceplugin.shared.settings import NODE_AGENT_DAEMONSETS, DaemonSetRef

log = logging.getLogger(__name__)

# The grant directories of both modes under the host root (hostfiles.py): while any holds a
# share, the hook files stay.
GRANT_DIRS = ("containers", "claims")
# Temporary names the agents and the install-hook init container write under the host root.
_TEMP_PREFIXES = (".checkpoint.", ".ld.so.preload")
_UNANSWERED = (KubeError, aiohttp.ClientError, OSError, asyncio.TimeoutError)


@dataclass(frozen=True, slots=True)
class Verdict:
    uninstalled: bool | None  # None: cannot tell (then nothing is removed)
    other_agent: bool  # another node agent's DaemonSet exists: the hook files stay
    why: str


def _deleting(obj: Mapping[str, object] | None) -> bool:
    """Gone, or being deleted."""
    if obj is None:
        return True
    meta = obj.get("metadata")
    return isinstance(meta, dict) and bool(meta.get("deletionTimestamp"))


class UninstallWatch:
    """Watches the DaemonSets of the agent's namespace and says, at the stop, whether the agent
    is being uninstalled (``decide``). ``run`` on the agent's event loop until the stop."""

    def __init__(
        self,
        daemonset: DaemonSetRef,
        *,
        timeout_s: float = 5.0,
        settings: InformerSettings | None = None,
    ) -> None:
        self.daemonset = daemonset
        self.others = tuple(n for n in NODE_AGENT_DAEMONSETS if n != daemonset.name)
        self.timeout_s = timeout_s
        self.settings = settings or InformerSettings()
        self.seen = False  # its DaemonSet was seen to exist
        self._api: Api | None = None
        self._informer: Informer | None = None

    async def run(self, api: Api) -> None:
        """List and watch until cancelled."""
        self._api = api
        self._informer = Informer(
            api,
            DAEMONSETS,
            namespace=self.daemonset.namespace,
            handler=self._observe,
            name="daemonsets",
            settings=self.settings,
        )
        await self._informer.run()

    async def run_with_client(self, kubeconfig: Path | None) -> None:
        """``run`` with a client of its own (an agent with no long-lived one)."""
        async with kube_client(kubeconfig) as api:
            await self.run(api)

    def _observe(self, event: str, obj: RawBody) -> None:
        if event != "DELETED" and (obj.get("metadata") or {}).get("name") == self.daemonset.name:
            self.seen = True

    async def _get(self, api: Api, name: str) -> Mapping[str, object] | None:
        path = DAEMONSETS.path(self.daemonset.namespace, name)
        try:
            return await call_json(api, "GET", path, timeout_s=self.timeout_s)
        except KubeNotFound:
            return None

    async def decide(self) -> Verdict:
        """Ask the API server; when it does not answer, what the watch saw last."""
        own_ref, api, informer = self.daemonset, self._api, self._informer
        if api is None or informer is None:
            return Verdict(None, True, "the API server was never reached")
        own: Mapping[str, object] | None
        answered = True
        try:
            own = await self._get(api, own_ref.name)
            others = [await self._get(api, name) for name in self.others]
            source = "the API server says so"
        except _UNANSWERED as exc:
            answered = False
            error = str(exc) or type(exc).__name__
            if not informer.has_synced:
                return Verdict(None, True, f"the API server cannot be asked: {error}")
            own = informer.get(own_ref.name, own_ref.namespace)
            others = [informer.get(name, own_ref.namespace) for name in self.others]
            source = f"as last watched; the API server does not answer now: {error}"
        if not _deleting(own):
            # Seen by the watch alone, it exists: most likely a restart, but not known.
            uninstalled = False if answered else None
            return Verdict(uninstalled, True, f"DaemonSet {own_ref} exists ({source}): a restart")
        if not self.seen:
            return Verdict(
                None, True, f"DaemonSet {own_ref} was never seen to exist: is --daemonset right?"
            )
        state = "gone" if own is None else "being deleted"
        return Verdict(
            True,
            any(not _deleting(o) for o in others),
            f"DaemonSet {own_ref} is {state} ({source}): uninstalled",
        )


@dataclass(frozen=True, slots=True)
class AgentFiles:
    """What one agent writes on the node."""

    host_root: Path
    grants: Path  # one directory per share, named after it (containers/ or claims/)
    cdi_root: Path | None
    cdi_prefix: str  # its CDI specs: <cdi_root>/<cdi_prefix><share>.json
    sockets: tuple[Path, ...] = ()  # removed whatever still runs
    checkpoint: Path | None = None  # removed once no share is kept
    own_dir: Path | None = None  # a directory of its own only (DRA: plugins/<driver>/), likewise
    # What the other mode's agent leaves under the host root when a helm upgrade switched modes
    # under running shares (its grant directory, its checkpoint): removed with their CDI specs
    # once no share of either mode runs on the node.
    foreign: tuple[Path, ...] = ()


def _entries(directory: Path | None) -> Iterator[Path]:
    if directory is not None and directory.is_dir():
        yield from directory.iterdir()


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def clean_up(
    verdict: Verdict,
    files: AgentFiles,
    running: Collection[str],
    node_idle: bool | None = None,
) -> None:
    """The agent's last step at its stop: remove its host files if it is being uninstalled,
    ``running`` being the names of its shares that still run; ``node_idle``: kubelet lists no
    container holding a fracgpu share of either mode (None: not known)."""
    if verdict.uninstalled is None:
        log.warning("stopping; host files left as they are", extra={"why": verdict.why})
        return
    if not verdict.uninstalled:
        log.info("stopping; host files left as they are", extra={"why": verdict.why})
        return
    log.info("removing this agent's host files", extra={"why": verdict.why})
    try:
        remove_host_files(files, running, other_agent=verdict.other_agent, node_idle=node_idle)
    except OSError as exc:
        log.error("host files not all removed", extra={"error": str(exc)})


def remove_host_files(
    files: AgentFiles,
    running: Collection[str],
    *,
    other_agent: bool,
    node_idle: bool | None = None,
) -> list[str]:
    """Remove what an uninstalled agent wrote, but the files of ``running`` shares; the shares
    kept, by name. With no other agent installed and ``node_idle``, what the other mode's agent
    left too."""
    kept = sorted(e.name for e in _entries(files.grants) if e.name in running)
    for entry in _entries(files.grants):
        if entry.name not in running:
            _remove(entry)
    for spec in _entries(files.cdi_root):
        ours = spec.name.startswith(files.cdi_prefix) and spec.name.endswith(".json")
        if ours and spec.name[len(files.cdi_prefix) : -len(".json")] not in running:
            spec.unlink(missing_ok=True)
    for socket in files.sockets:
        socket.unlink(missing_ok=True)
    if kept:
        log.info(
            "uninstalled; the files of shares still running stay on the node (their containers "
            "read them), and with them the checkpoint and the hook",
            extra={"kept": kept, "dir": str(files.grants)},
        )
        return kept
    if files.checkpoint is not None:
        files.checkpoint.unlink(missing_ok=True)
    if files.own_dir is not None:
        shutil.rmtree(files.own_dir, ignore_errors=True)
    _rmdir(files.grants)
    if not other_agent:
        _remove_foreign(files, node_idle)
    _remove_hook(files.host_root, other_agent=other_agent)
    return kept


def _remove_foreign(files: AgentFiles, node_idle: bool | None) -> None:
    """The other mode's leftovers, with the CDI spec of each of its shares (named
    ``<prefix>_<share>.json``), once kubelet lists no fracgpu share on the node."""
    left = [p for p in files.foreign if p.exists()]
    if not left:
        return
    if node_idle is not True:
        why = "kubelet lists a share" if node_idle is False else "kubelet could not be asked"
        log.info("the other mode's files stay on the node", extra={"why": why})
        return
    shares = {e.name for p in left if p.is_dir() for e in _entries(p)}
    for spec in _entries(files.cdi_root):
        name = spec.name
        if "fracgpu" in name and name.endswith(".json") and name[:-5].rpartition("_")[2] in shares:
            spec.unlink(missing_ok=True)
    for path in left:
        _remove(path)
    log.info("uninstalled; the other mode's leftovers removed", extra={"shares": sorted(shares)})


def _remove_hook(root: Path, *, other_agent: bool) -> None:
    """The hook, the preload file and the host root, unless a share or another agent needs them.
    Only fracgpu's own names are removed: a wrong --host-root loses nothing else."""
    shares = [str(e) for name in GRANT_DIRS for e in _entries(root / name)]
    if other_agent or shares:
        why = "another node agent is installed" if other_agent else "shares of it remain"
        log.info("uninstalled; the hook stays on the node", extra={"why": why, "shares": shares})
        return
    _remove(hook_library(root).parent)
    ld_so_preload(root).unlink(missing_ok=True)
    for entry in _entries(root):
        if entry.name.startswith(_TEMP_PREFIXES) or entry.name in GRANT_DIRS:
            _remove(entry)
    _rmdir(root)
    log.info("uninstalled; the hook and the host root removed", extra={"host_root": str(root)})


def _rmdir(path: Path) -> None:
    try:
        path.rmdir()
    except FileNotFoundError:
        return  # gone already
    except OSError as exc:
        # EBUSY: the host root is this pod's mount point, and stays as an empty directory.
        level = logging.DEBUG if exc.errno == errno.EBUSY else logging.INFO
        log.log(level, "directory left", extra={"dir": str(path), "error": exc.strerror})


__all__ = [
    "GRANT_DIRS",
    "AgentFiles",
    "UninstallWatch",
    "Verdict",
    "clean_up",
    "remove_host_files",
]
