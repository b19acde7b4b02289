"""What an Allocate answer carries (answers), and what a waiting container is told."""

from __future__ import annotations

from pathlib import Path

import pytest

from core import contract
from core.contract import VISIBLE_DEVICES_ENV
from core.units import ENV_MEMORY_MIB
from deviceplugin._proto import deviceplugin_v1beta1_pb2 as pb
from deviceplugin.classic.allocation import Allocation, container_dir_name
from deviceplugin.classic.answers import card_response, no_card, static_response
from deviceplugin.classic.config import Config
from deviceplugin.classic.ids import core_id, memory_id
from deviceplugin.classic.ledger import CardUsage
from deviceplugin.shared.cdispec import CONTROL_DEVICES
from deviceplugin.shared.inventory import Card

CARDS = {i: Card(i, f"GPU-{i}", "Fake", 2048 * (i + 1), 10 + i, None) for i in range(2)}
CONFIG = Config(host_root=Path("/h"), dev_root=Path("/devroot"))


def allocation(core: int, memory: int, cards: tuple[int, ...] = ()) -> Allocation:
    return Allocation(
        core=tuple(core_id(0, i) for i in range(core)),
        memory=tuple(memory_id(0, i) for i in range(memory)),
        cards=cards,
        created=0.0,
    )


def test_static_response() -> None:
    record = allocation(30, 2)
    response = pb.ContainerAllocateResponse()
    static_response(CONFIG, record.core, response)
    assert response.envs[VISIBLE_DEVICES_ENV] == contract.DEVICE_LIST_MOUNT_ROOT
    assert [d.host_path for d in response.devices] == [f"/devroot/{n}" for n in CONTROL_DEVICES]
    base = f"/h/containers/{container_dir_name(record.core)}"
    mounts = {m.container_path: (m.host_path, m.read_only) for m in response.mounts}
    assert mounts == {
        contract.CONTAINER_HOOK_LIBRARY: (str(CONFIG.hook_library), True),
        contract.LD_SO_PRELOAD: (str(CONFIG.ld_so_preload), True),
        contract.CONTAINER_LIMITS_DIR: (f"{base}/limits", True),
        contract.CONTAINER_SHARED_DIR: (f"{base}/shared", False),
    }


CARD = [  # (allocation, device nodes, the memory variable)
    pytest.param(allocation(30, 2, (1,)), ["/devroot/nvidia11"], None, id="a share"),
    pytest.param(allocation(100, 0, (0,)), ["/devroot/nvidia10"], "2048", id="a whole card"),
    pytest.param(
        allocation(200, 0, (0, 1)),
        ["/devroot/nvidia10", "/devroot/nvidia11"],
        "2048",  # the smaller card's: each gets as much
        id="two whole cards",
    ),
    pytest.param(allocation(100, 8, (0,)), ["/devroot/nvidia10"], None, id="whole, with memory"),
]


@pytest.mark.parametrize(("record", "nodes", "memory"), CARD)
def test_card_response(record: Allocation, nodes: list[str], memory: str | None) -> None:
    response = pb.ContainerAllocateResponse()
    card_response(CONFIG, CARDS, record, response)
    assert [d.host_path for d in response.devices] == nodes
    assert [m.container_path for m in response.mounts] == [
        f"{contract.DEVICE_LIST_MOUNT_ROOT}/{CARDS[i].uuid}" for i in record.cards
    ]
    assert response.envs.get(ENV_MEMORY_MIB) == memory


def usage(core_used: int, memory_used: int, *, healthy: bool = True, card: int = 0) -> CardUsage:
    return CardUsage(CARDS[card], 8, core_used, memory_used, healthy, "")


NO_CARD = [  # (allocation, the cards' usage, what the message says)
    pytest.param(
        allocation(30, 2),
        [usage(80, 1)],
        ["0.30 card and 512 MiB of one card", "the most free is 0.20 card and 1792 MiB on card 0"],
        id="a share",
    ),
    pytest.param(allocation(100, 0), [usage(10, 1)], ["1 entirely free card"], id="a whole card"),
    pytest.param(allocation(200, 0), [usage(10, 1)], ["2 entirely free cards"], id="two cards"),
    pytest.param(
        allocation(30, 2),
        [usage(0, 0, healthy=False)],
        ["no card of this node is healthy"],
        id="none healthy",
    ),
    pytest.param(
        allocation(30, 2),
        [usage(90, 1), usage(50, 7, card=1)],
        ["0.50 card and 256 MiB on card 1"],
        id="the most free core",
    ),
]


@pytest.mark.parametrize(("record", "cards", "says"), NO_CARD)
def test_no_card(record: Allocation, cards: list[CardUsage], says: list[str]) -> None:
    message = no_card(record, cards)
    for part in says:
        assert part in message
    assert message.endswith("delete the pod to have it scheduled elsewhere")
