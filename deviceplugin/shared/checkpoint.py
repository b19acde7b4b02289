"""Versioned checkpoints: a typed document per agent, written atomically, older files upgraded.

Each agent declares its document as a pydantic model (``extra="forbid"`` and a ``version``
literal, so a file of another shape is refused instead of half-read) and a chain of upgrades,
one function per older version, each returning the next version's document. ``read`` walks the
chain, then validates. An upgrade is a plain dict transformation: it runs once per start on a
file of a few kilobytes, and keeping it apart from the model keeps today's model free of
yesterday's fields.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

Upgrade = Callable[[dict[str, Any]], dict[str, Any]]


class CheckpointError(ValueError):
    """A checkpoint that cannot be used (corrupt, an unknown version, another node's cards)."""


class Document(BaseModel):
    """The base of every checkpoint model: unknown fields are an error, values are frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


M = TypeVar("M", bound=Document)


def write(path: Path, document: Document, *, durable: bool = True) -> None:
    """Write ``document`` (by its aliases, the names on disk) atomically. pydantic's own
    serializer makes the text: about four times faster than ``json.dumps`` of the same dict
    (0.6 against 2.5 ms for 800 allocations), which matters as the writer shares the
    interpreter lock with kubelet's calls."""
    _write_text(path, document.model_dump_json(by_alias=True), durable=durable)


def read(path: Path, model: type[M], *, upgrades: Mapping[int, Upgrade] | None = None) -> M | None:
    """The checkpoint at ``path`` as ``model``, older versions upgraded; None when there is none.

    ``upgrades[v]`` turns a version ``v`` document into the next version's. Raises
    CheckpointError for a file that is not JSON, has no known version, or does not fit.
    """
    try:
        document: Any = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path} is unreadable: {exc}") from exc
    if not isinstance(document, dict):
        raise CheckpointError(f"checkpoint {path} is not a JSON object")
    steps = dict(upgrades or {})
    seen: set[object] = set()
    while (version := document.get("version")) in steps and version not in seen:
        seen.add(version)
        document = steps[version](document)
    try:
        return model.model_validate(document)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(document)"
        raise CheckpointError(
            f"checkpoint {path} has an unsupported format (version {version!r}): "
            f"{where}: {first['msg']}"
        ) from None


def _write_text(path: Path, text: str, *, durable: bool) -> None:
    """Replace ``path`` atomically: a reader sees the old file or the new one.

    ``durable`` (fsync of the file and its directory) makes that hold across a crash of the
    node too; without it a crash may leave the old file, or an empty one that reads as corrupt.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".checkpoint.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            if durable:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if not durable:
        return
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


__all__ = ["CheckpointError", "Document", "Upgrade", "read", "write"]
