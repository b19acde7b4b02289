"""What an Allocate answer carries, and what a container that no card can host yet is told.

Every fracgpu container gets the same part, whichever card it lands on (:func:`static_response`):
the hook, its preload file, the container's directories and the control devices. The
card-specific part (:func:`card_response`) is in the answer only without CDI; with CDI it goes
into the spec PreStartContainer writes (``containerfiles.cdi_spec``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from core import contract
from core.contract import VISIBLE_DEVICES_ENV
from core.units import BLOCK_MIB, CORE_PER_CARD, ENV_MEMORY_MIB, cards_phrase
from deviceplugin._proto import deviceplugin_v1beta1_pb2 as pb
from deviceplugin.classic.allocation import Allocation
from deviceplugin.classic.config import Config
from deviceplugin.classic.containerfiles import container_dirs
from deviceplugin.classic.ledger import CardUsage
from deviceplugin.shared.cdispec import CONTROL_DEVICES
from deviceplugin.shared.inventory import Card


def static_response(
    config: Config, core: Iterable[str], response: pb.ContainerAllocateResponse
) -> None:
    """What every fracgpu container gets, whichever card it lands on."""
    # Only named here: they are made with the limits file, by the early verification or by
    # PreStartContainer, which kubelet completes before it creates the container. Allocate
    # stays in memory, off the disk, while kubelet admits the pod.
    limits_dir, shared_dir = container_dirs(config, core)
    # The cards reach the container as the NVIDIA toolkit's device-list mounts, which only
    # the node agent can make; the variable names their directory and selects nothing by
    # itself, so one a user sets (envFrom) hands out no card (install guide).
    response.envs[VISIBLE_DEVICES_ENV] = contract.DEVICE_LIST_MOUNT_ROOT
    dev = config.dev_root
    for name in CONTROL_DEVICES:
        response.devices.add(
            container_path=f"/dev/{name}", host_path=str(dev / name), permissions="rw"
        )
    for host, path, read_only in (
        (config.hook_library, contract.CONTAINER_HOOK_LIBRARY, True),
        (config.ld_so_preload, contract.LD_SO_PRELOAD, True),
        (limits_dir, contract.CONTAINER_LIMITS_DIR, True),
        (shared_dir, contract.CONTAINER_SHARED_DIR, False),
    ):
        response.mounts.add(container_path=path, host_path=str(host), read_only=read_only)


def card_response(
    config: Config,
    cards: Mapping[int, Card],
    allocation: Allocation,
    response: pb.ContainerAllocateResponse,
) -> None:
    """The card-specific part, in the Allocate answer (without CDI)."""
    placed = [cards[i] for i in allocation.cards]
    for card in placed:
        response.mounts.add(
            container_path=f"{contract.DEVICE_LIST_MOUNT_ROOT}/{card.uuid}",
            host_path=contract.DEVICE_LIST_HOST_PATH,
            read_only=True,
        )
        response.devices.add(
            container_path=f"/dev/nvidia{card.minor}",
            host_path=str(config.dev_root / f"nvidia{card.minor}"),
            permissions="rw",
        )
    if allocation.whole_cards_only:
        # Whole cards carry no memory resource: all of each card is theirs, and only the
        # node knows how much that is.
        response.envs[ENV_MEMORY_MIB] = str(min(c.memory_mib for c in placed))


def no_card(allocation: Allocation, usage: Iterable[CardUsage]) -> str:
    """Why a container waits, in the user's units, with the closest card (``usage``: the
    ledger's cards now)."""
    if allocation.whole_cards:
        n = allocation.whole_cards
        ask = f"{n} entirely free {'card' if n == 1 else 'cards'}"
    else:
        ask = (
            f"{cards_phrase(len(allocation.core))} and "
            f"{len(allocation.memory) * BLOCK_MIB} MiB of one card"
        )
    best = max(
        (u for u in usage if u.healthy),
        key=lambda u: (CORE_PER_CARD - u.core_used, u.blocks - u.memory_used),
        default=None,
    )
    closest = (
        "no card of this node is healthy"
        if best is None
        else f"the most free is {cards_phrase(CORE_PER_CARD - best.core_used)} and "
        f"{(best.blocks - best.memory_used) * BLOCK_MIB} MiB on card {best.card.index}"
    )
    return (
        f"no card of this node can host {ask} yet ({closest}): kubelet admitted the pod in "
        f"the moment after the node's capacity changed (pods ending or starting), when what "
        f"it counted free lay on several cards. It starts as soon as a share on this node "
        f"ends (kubelet retries every 10-15 s); delete the pod to have it scheduled elsewhere"
    )
