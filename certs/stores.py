"""Where managed certificates live, behind one compare-and-swap interface.

``load`` returns the stored files and a version; ``save`` writes only if the version is still
the stored one and raises ``StoreConflict`` otherwise. Whoever loses a race re-reads and uses
the winner's certificates, so replicas (or a server and ``fracgpu certs rotate``) never serve
different CAs for long and never overwrite each other's fresh certificates.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import logging
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Protocol

from certs.material import MANAGED_FILES, PRIVATE_FILES

log = logging.getLogger(__name__)

Files = dict[str, bytes]


class StoreConflict(Exception):
    """Someone else changed the store since it was read."""


class CertificateStore(Protocol):
    """Managed certificates, read and written as a whole."""

    @property
    def description(self) -> str: ...

    async def load(self) -> tuple[Files | None, str | None]:
        """The stored files (None if nothing is stored) and their version."""
        ...

    async def save(self, files: Mapping[str, bytes], version: str | None) -> str:
        """Writes ``files`` if the store is still at ``version`` (None: still empty)."""
        ...


class DirectoryStore:
    """A local directory: one file per key, keys 0600, directory 0700.

    Each file is replaced atomically (write to a temporary name, fsync, rename); readers and
    writers of the whole set hold a lock on ``.lock`` (shared to read, exclusive to write), so a
    reader never sees a new certificate next to an old key, even across processes.
    """

    LOCK = ".lock"

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    @property
    def description(self) -> str:
        return f"directory {self.directory}"

    async def load(self) -> tuple[Files | None, str | None]:
        return await asyncio.to_thread(self._load)

    async def save(self, files: Mapping[str, bytes], version: str | None) -> str:
        return await asyncio.to_thread(self._save, dict(files), version)

    def _load(self) -> tuple[Files | None, str | None]:
        if not self.directory.is_dir():
            return None, None
        with self._locked(fcntl.LOCK_SH):
            return self._read()

    def _read(self) -> tuple[Files | None, str | None]:
        files: Files = {}
        for name in MANAGED_FILES:
            path = self.directory / name
            with contextlib.suppress(FileNotFoundError):
                files[name] = path.read_bytes()
        if not files:
            return None, None
        return files, _version(files)

    def _save(self, files: Files, version: str | None) -> str:
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        with self._locked(fcntl.LOCK_EX):
            _, stored = self._read()
            if stored != version:
                raise StoreConflict(f"{self.description} changed since it was read")
            for name in MANAGED_FILES:
                if name in files:
                    _write_atomic(self.directory / name, files[name], private=name in PRIVATE_FILES)
            _fsync_dir(self.directory)
        return _version(files)

    @contextlib.contextmanager
    def _locked(self, how: int) -> Iterator[None]:
        fd = os.open(self.directory / self.LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, how)
            yield
        finally:
            os.close(fd)


def _version(files: Mapping[str, bytes]) -> str:
    h = hashlib.sha256()
    for name in sorted(files):
        h.update(name.encode())
        h.update(len(files[name]).to_bytes(8, "big"))
        h.update(files[name])
    return h.hexdigest()


def _write_atomic(path: Path, data: bytes, *, private: bool) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    try:
        # The mode given to open() is masked by umask and ignored for an existing file.
        os.fchmod(fd, 0o600 if private else 0o644)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
