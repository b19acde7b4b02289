"""A node agent's configuration across a process boundary: the benchmarks run the agent in a
process of its own and hand it the configuration as JSON."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def _plain(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, frozenset):
        return sorted(value)
    return value


def to_json(config: Any) -> str:
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    return json.dumps({k: _plain(v) for k, v in fields.items() if v is not None})


def from_json(cls: type[T], text: str) -> T:
    raw: dict[str, Any] = json.loads(text)
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        if field.name not in raw:
            continue
        if "Path" in str(field.type):
            raw[field.name] = Path(raw[field.name])
        elif "frozenset" in str(field.type):
            raw[field.name] = frozenset(raw[field.name])
    return cls(**raw)
