"""A node agent's configuration across a process boundary: the benchmarks run the agent in a
process of its own and hand it the configuration as JSON."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar, get_type_hints

T = TypeVar("T")


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        return {k: _plain(v) for k, v in fields.items()}
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, frozenset):
        return sorted(value)
    return value


def to_json(config: Any) -> str:
    return json.dumps(_plain(config))


def _typed(kind: Any, value: Any) -> Any:
    """``value`` from JSON as the field's type (nested settings, paths and sets)."""
    if value is None:
        return None
    if dataclasses.is_dataclass(kind) and isinstance(kind, type):
        return _from_dict(kind, value)
    if "Path" in str(kind):
        return Path(value)
    if "frozenset" in str(kind):
        return frozenset(value)
    return value


def _from_dict(cls: type[T], raw: dict[str, Any]) -> T:
    hints = get_type_hints(cls)
    values = {
        f.name: _typed(hints[f.name], raw[f.name])
        for f in dataclasses.fields(cls)  # type: ignore[arg-type]
        if f.name in raw
    }
    return cls(**values)


def from_json(cls: type[T], text: str) -> T:
    return _from_dict(cls, json.loads(text))


@contextmanager
def agent_process(module: str, config: Any, env: Mapping[str, str]) -> Iterator[None]:
    """Run ``python -m <module> --serve <config as JSON>`` (with ``env`` added) until the block
    ends; the agent stops when its stdin closes."""
    path = os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))
    process = subprocess.Popen(
        [sys.executable, "-m", module, "--serve", to_json(config)],
        stdin=subprocess.PIPE,
        env={**os.environ, **env, "PYTHONPATH": path},
    )
    try:
        yield
    finally:
        assert process.stdin is not None
        process.stdin.close()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGKILL)
            process.wait()
