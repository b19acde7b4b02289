"""A node agent's configuration survives the JSON hop into the benchmark's agent process,
nested settings (the guard's) included."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench._config import from_json, to_json
from deviceplugin.classic.config import Config
from deviceplugin.dra.config import DraConfig
from deviceplugin.shared.settings import GuardSettings


@pytest.mark.parametrize(
    "config",
    [
        pytest.param(Config(), id="device-plugin-defaults"),
        pytest.param(
            Config(
                host_root=Path("/x"),
                cdi_root=None,
                ignored_xids=frozenset({13, 43}),
                guard=GuardSettings(interval_s=0.1, kill=False, proc_root=Path("/p")),
            ),
            id="device-plugin-set",
        ),
        pytest.param(DraConfig(node_name="n", guard=GuardSettings(grace_s=3.0)), id="dra"),
    ],
)
def test_round_trip(config: Config | DraConfig) -> None:
    assert from_json(type(config), to_json(config)) == config
