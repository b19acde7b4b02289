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
