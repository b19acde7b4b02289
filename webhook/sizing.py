"""What was asked, sized: card sizes and defaults applied to a ``ContainerAsk``.

Device-plugin mode sizes each container's request here into the grant admission writes; DRA mode
sizes it here once per GPU model (``webhook.claims``). Defaults where the user says less
(documented in docs/user-guide.md):

* a fraction without memory gets the same fraction of the card's memory, rounded *down* to
  whole blocks so that shares summing to one card always fit on it;
* memory without a fraction gets the smallest share of compute that is at least the same
  fraction of the card (rounded *up* to 0.01), so memory-only pods are not starved;
* whole cards always get all of the memory of the cards they land on; admission needs no card
  model for them, so a pod that would scale up a GPU node pool is admitted while the pool is
  empty, and a whole card on a bigger model is not held to a smaller one's size.

Percentages use the same block arithmetic as fractions, for the same reason.
"""

from __future__ import annotations

from core.contract import MAX_DEVICES
from core.units import BLOCK_MIB, CORE_PER_CARD, MIB, Grant, card_blocks, ceil_div
from webhook.gpumodels import CardChoice, GpuModel
from webhook.parsing import ContainerAsk, RequestError
from webhook.wording import container_ref

DEFAULT_MAX_CARDS = MAX_DEVICES
"""Whole cards one container may ask for (``admission.max_cards``): as many as a container's
limits file can name, more than most nodes have."""


def several_cards_need_dra(name: str, ask: ContainerAsk) -> str:
    """Device-plugin mode's denial of a share of several cards, in the user's terms.

    kubelet's device manager hands a container devices from one resource, summed: it cannot say
    that 60 hundredths are 30 on each of two cards, and a plugin that guessed would fail pods
    on the node. One DRA claim request with ``count`` and capacity per card says exactly that.
    """
    return (
        f"{container_ref(name)}: asks for a share of each of {ask.count} cards "
        f"({ask.count_key}: {ask.count}); in device-plugin mode a container gets a share of one "
        f"card or whole cards, and only DRA mode (Kubernetes 1.36 and newer) can give a share "
        f"of several; ask the operator for DRA mode (kubectl fracgpu mode), or ask for whole "
        f"cards, or for one card's share"
    )


def check_count(name: str, ask: ContainerAsk, max_cards: int) -> None:
    if ask.count > max_cards:
        raise RequestError(
            f"{container_ref(name)}: {ask.count_key} asks for a share of {ask.count} cards; a "
            f"container may have at most {max_cards} cards (admission.max_cards); ask for fewer"
        )


def _need_card(name: str, choice: CardChoice, why: str) -> GpuModel:
    if choice.card is None:
        raise RequestError(
            f"{container_ref(name)}: cannot {why}: {choice.unknown}; set fracgpu.io/gpumem "
            f"together with fracgpu.io/gpu, or have the operator configure the GPU inventory "
            f"(node labels fracgpu.io/gpu.product and fracgpu.io/gpu.memory-mib, or "
            f"inventory.models in the webhook configuration)"
        )
    return choice.card


def resolve(
    name: str, ask: ContainerAsk, choice: CardChoice, max_cards: int, warnings: list[str]
) -> Grant:
    """Apply card sizes and defaults to what was asked; the only place defaults live."""
    blocks = ask.memory_blocks
    if ask.memory_mib is not None:
        blocks = ceil_div(ask.memory_mib, BLOCK_MIB)
    if blocks is not None:
        _check_fits(name, ask, blocks, choice)
    core = ask.core
    if core is not None and core >= CORE_PER_CARD:
        return _whole_cards(name, ask, blocks, max_cards, warnings)
    if ask.memory_mib is not None and blocks is not None and blocks * BLOCK_MIB != ask.memory_mib:
        warnings.append(
            f"{container_ref(name)}: {ask.memory_mib} MiB of GPU memory rounded up to "
            f"{blocks * BLOCK_MIB} MiB (GPU memory is granted in {BLOCK_MIB} MiB blocks)"
        )
    used: GpuModel | None = None
    if blocks is None:
        percent = ask.memory_percent
        used = _need_card(
            name,
            choice,
            "work out GPU memory for the request"
            if percent is None
            else "convert fracgpu.io/gpumem-percentage to MiB",
        )
        share = percent if percent is not None else core
        assert share is not None  # a request names at least one of core and memory
        blocks = max(1, card_blocks(used.memory_mib) * share // 100)
    if core is None:
        _need_card(name, choice, "work out the card share for a memory-only request")
        # Sized for the smallest model that holds it: a smaller one cannot host the pod.
        used = choice.fitting(blocks)
        assert used is not None
        per_card = max(card_blocks(used.memory_mib), 1)
        core = min(CORE_PER_CARD, max(1, ceil_div(blocks * CORE_PER_CARD, per_card)))
    warning = choice.warning(used) if used is not None else None
    if warning:
        warnings.append(f"{container_ref(name)}: {warning}")
    return Grant(core, blocks)


def _whole_cards(
    name: str, ask: ContainerAsk, blocks: int | None, max_cards: int, warnings: list[str]
) -> Grant:
    """Whole cards need no card model: they get all of each card, which the node knows."""
    assert ask.core is not None
    core = ask.core
    cards = core // CORE_PER_CARD
    if cards > max_cards:
        raise RequestError(
            f"{container_ref(name)}: {ask.core_key} asks for more whole cards than a node has: "
            f"a container may have at most {max_cards} cards (admission.max_cards); "
            f"got {ask.core_shown}; ask for fewer cards"
        )
    if ask.exact:
        # Our own output, or a tool's: kept as is, so admitting it again changes nothing.
        return Grant(core, 0 if blocks is None else blocks * cards)
    if blocks is not None or (ask.memory_percent or 100) < 100:
        warnings.append(
            f"{container_ref(name)}: whole cards come with all of their memory; "
            f"the memory limit is ignored"
        )
    return Grant(core, 0)


MAX_CARD_MIB = 2**20
"""No GPU has a TiB of memory: more is a typo (bytes written as MiB), known models or not."""


def _check_fits(name: str, ask: ContainerAsk, blocks: int, choice: CardChoice) -> None:
    """Deny memory that no candidate card has: it would only fail later, on the node.

    The canonical form is held only to what any card could have: it was sized against the
    candidates when it was first admitted, and they may be scaled to zero now.
    """
    largest = None if ask.exact else choice.largest
    if largest is None:
        limit, what = card_blocks(MAX_CARD_MIB), "any GPU"
    else:
        limit, what = card_blocks(largest.memory_mib), largest.product
    if blocks <= limit:
        return
    hint = ""
    if ask.memory_mib is not None and ask.memory_mib >= MIB:
        hint = " (a plain number is MiB; write a binary suffix such as 8Gi for bytes)"
    raise RequestError(
        f"{container_ref(name)}: asks for {blocks * BLOCK_MIB} MiB of GPU memory per card, more "
        f"than {what} has ({limit * BLOCK_MIB} MiB usable); ask for less memory, or for whole "
        f"cards{hint}"
    )
