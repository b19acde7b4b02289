"""``kubectl fracgpu top`` (each card, its shares and what it has free) and ``kubectl fracgpu
fit SHAPE`` (which cards could take a pod of that shape now, or why none), both modes.

Both read the cluster through :mod:`fracgpu.cards`. A share is shown in cards and MiB, as a
user writes it. ``fit`` applies the webhook's rules to the shape (a share of one card, 0.01 to
1 with two decimals, or whole cards; memory as written, rounded up to the 256 MiB block, and
without ``--gpumem`` the share's part of each card's memory, rounded down) and tells the cards
in the order the device plugin would choose among them (best fit: the fullest card that fits);
in DRA mode the scheduler chooses, among the same cards.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp
import yaml

from core.kube import KubeConfigError, KubeError, kube_client
from core.units import BLOCK_MIB, CORE_PER_CARD, UnitError, cards_phrase, cards_text, parse_cards
from core.units import parse_mib as parse_memory
from fracgpu import usage
from fracgpu.cards import DEVICE_PLUGIN, CardView, ClusterCards, Share, apply_live, read
from webhook.waiting import CardNeed, FreeCard, explain


@dataclass(frozen=True, slots=True)
class Shape:
    cores: int  # hundredths of one card; 0 with ``cards``
    memory_mib: int | None  # None: the share's part of each card's memory
    cards: int = 0  # whole cards
    count: int = 1  # a share on this many cards of one node (fracgpu.io/gpu-count; DRA mode)

    def need_mib(self, card: CardView) -> int:
        if self.memory_mib is not None:
            return self.memory_mib
        return card.memory_mib * self.cores // CORE_PER_CARD // BLOCK_MIB * BLOCK_MIB

    def phrase(self) -> str:
        if self.cards:
            return f"{self.cards} whole {'card' if self.cards == 1 else 'cards'}"
        memory = (
            "its part of the card's memory"
            if self.memory_mib is None
            else (f"{self.memory_mib} MiB")
        )
        share = f"{cards_phrase(self.cores)} and {memory}"
        return share if self.count == 1 else f"{share} on each of {self.count} cards"


def parse_shape(gpu: str, gpumem: str | None, count: int = 1) -> Shape:
    """The shape as the webhook reads it; UnitError with the rule when it is not one."""
    cores = parse_cards(gpu, source="pod")
    if cores <= 0:
        raise UnitError("fracgpu.io/gpu must be more than 0")
    if count < 1:
        raise UnitError("--count (fracgpu.io/gpu-count) must be at least 1")
    if cores >= CORE_PER_CARD:
        if gpumem is not None:
            raise UnitError("whole cards come with all their memory: leave --gpumem out")
        if count > 1 and cores > CORE_PER_CARD:
            raise UnitError("--count is for a share of each card: give whole cards as SHAPE alone")
        return Shape(0, None, count * cores // CORE_PER_CARD)
    if gpumem is None:
        return Shape(cores, None, count=count)
    mib = parse_memory(gpumem, source="pod")
    if mib <= 0:
        raise UnitError("--gpumem must be at least 1 MiB")
    return Shape(cores, -(-mib // BLOCK_MIB) * BLOCK_MIB, count=count)


def fitting(shape: Shape, cards: list[CardView]) -> list[CardView]:
    """The healthy cards that can take the shape now, best fit first (device plugin's order)."""
    if shape.cards:
        whole = [c for c in cards if c.healthy and c.free_cores == CORE_PER_CARD]
        per_node: dict[str, list[CardView]] = {}
        for card in whole:
            per_node.setdefault(card.node, []).append(card)
        return [c for group in per_node.values() if len(group) >= shape.cards for c in group]
    fits = [
        c
        for c in cards
        if c.healthy and c.free_cores >= shape.cores and c.free_mib >= shape.need_mib(c)
    ]
    if shape.count > 1:
        # The claim's cards are distinct cards of the one node the pod runs on.
        on_node: dict[str, int] = {}
        for card in fits:
            on_node[card.node] = on_node.get(card.node, 0) + 1
        fits = [c for c in fits if on_node[c.node] >= shape.count]
    return sorted(fits, key=lambda c: (c.free_cores, c.free_mib, c.node, c.device))


def why_none(shape: Shape, view: ClusterCards) -> str:
    """The webhook's sentence for a shape that fits nowhere (its ``GPUShareDoesNotFit``)."""
    free = [
        FreeCard(c.free_cores if c.healthy else 0, c.free_mib if c.healthy else 0, c.node, c.device)
        for c in view.cards
    ]
    memory = shape.memory_mib if shape.memory_mib is not None else 0
    ask = (
        CardNeed(cards=shape.cards)
        if shape.cards
        else CardNeed(cores=shape.cores, memory_mib=memory, count=shape.count)
    )
    return explain([ask], free, device_plugin=view.mode == DEVICE_PLUGIN)


def _share_line(share: Share) -> str:
    what = (
        f"{share.cards} whole {'card' if share.cards == 1 else 'cards'}"
        if share.cards
        else f"{cards_phrase(share.cores)}, {share.memory_mib} MiB"
    )
    containers = f" ({', '.join(share.containers)})" if share.containers else ""
    live = ""
    if share.used_mib is not None:
        busy = "" if share.busy_percent is None else f", {share.busy_percent:.0f}% of the SMs busy"
        live = f"; using {share.used_mib} MiB{busy}"
    return f"{share.namespace}/{share.pod}{containers}: {what}{live}"


def render_top(view: ClusterCards, *, wide: bool) -> str:
    if not view.mode:
        return "no node publishes fracgpu cards (no fracgpu node agent runs, or it has no GPU)\n"
    header = f"{'NODE':<20} {'CARD':<8} {'USED':<22} {'FREE':<22} {'SHARES':<6}"
    lines = [header + (" MODEL" if wide else "")]
    for card in view.cards:
        used_cores = CORE_PER_CARD - card.free_cores
        used = f"{cards_text(used_cores)} / {card.memory_mib - card.free_mib} MiB"
        free = f"{cards_text(card.free_cores)} / {card.free_mib} MiB"
        if not card.healthy:
            free = "unhealthy"
        count = str(len(card.shares)) if view.mode != DEVICE_PLUGIN else "-"
        line = f"{card.node:<20} {card.device:<8} {used:<22} {free:<22} {count:<6}"
        lines.append(line + (f" {card.product}" if wide else ""))
        lines.extend(f"    {_share_line(s)}" for s in card.shares)
    for node, on_node in sorted(view.unplaced.items()):
        lines.append(f"{node}: shares on this node (the node agent places them on its cards)")
        lines.extend(f"    {_share_line(s)}" for s in on_node)
    return "\n".join(lines) + "\n"


def _scoped(view: ClusterCards, args: argparse.Namespace) -> ClusterCards:
    """Only ``--node``'s cards, and only the shares of ``-n``'s namespace unless ``-A``."""
    cards = [c for c in view.cards if not args.node or c.node == args.node]
    if not args.all_namespaces and args.namespace:
        for card in cards:
            card.shares = [s for s in card.shares if s.namespace == args.namespace]
    unplaced = {
        node: [s for s in shares if args.all_namespaces or not args.namespace
               or s.namespace == args.namespace]
        for node, shares in view.unplaced.items()
        if not args.node or node == args.node
    }  # fmt: skip
    return ClusterCards(view.mode, cards, {n: s for n, s in unplaced.items() if s})


def _dump(document: Any, output: str) -> str:
    if output == "json":
        return json.dumps(document, indent=2) + "\n"
    return str(yaml.safe_dump(document, sort_keys=False))


async def _view(args: argparse.Namespace, *, live: bool) -> ClusterCards:
    async with kube_client(args.kubeconfig, args.context) as api:
        view = await read(api)
        if live and view.mode:
            nodes = {c.node for c in view.cards} | set(view.unplaced)
            uses, problems = await usage.read(api, [args.node] if args.node else nodes)
            for problem in problems:
                sys.stderr.write(f"fracgpu top: live use not shown: {problem}\n")
            view = apply_live(view, uses)
        return view


def _read(args: argparse.Namespace, command: str, *, live: bool = False) -> ClusterCards | None:
    try:
        return asyncio.run(_view(args, live=live))
    except (KubeConfigError, KubeError, aiohttp.ClientError, OSError) as exc:
        sys.stderr.write(f"fracgpu {command}: cannot ask the API server: {exc}\n")
        return None


def run_top(args: argparse.Namespace) -> int:
    view = _read(args, "top", live=args.live)
    if view is None:
        return 2
    view = _scoped(view, args)
    if args.output in ("json", "yaml"):
        sys.stdout.write(_dump(asdict(view), args.output))
    else:
        sys.stdout.write(render_top(view, wide=args.output == "wide"))
    return 0


def run_fit(args: argparse.Namespace) -> int:
    try:
        shape = parse_shape(args.gpu, args.gpumem, args.count)
    except UnitError as exc:
        sys.stderr.write(f"fracgpu fit: {args.gpu!r}: {exc}\n")
        return 2
    view = _read(args, "fit")
    if view is None:
        return 2
    several_in_dp = shape.count > 1 and view.mode == DEVICE_PLUGIN
    cards = [] if several_in_dp else fitting(shape, view.cards)
    why = (
        "this cluster runs fracgpu in device-plugin mode, which gives a container a share of "
        "one card or whole cards; a share of several cards needs DRA mode"
        if several_in_dp
        else ("" if cards else why_none(shape, view))
    )
    if args.output in ("json", "yaml"):
        document = {
            "shape": shape.phrase(),
            "mode": view.mode,
            "fits": [asdict(c) | {"shares": len(c.shares)} for c in cards],
            "why_not": why,
        }
        sys.stdout.write(_dump(document, args.output))
    elif cards:
        lines = [f"{shape.phrase()} fits now on {len(cards)} card(s), best fit first:"]
        for card in cards:
            rest = cards_text(card.free_cores - shape.cores)
            left = (
                ""
                if shape.cards
                else f", leaving {rest} card / {card.free_mib - shape.need_mib(card)} MiB"
            )
            lines.append(
                f"  {card.node} {card.device} ({card.product}): free "
                f"{cards_text(card.free_cores)} card / {card.free_mib} MiB{left}"
            )
        sys.stdout.write("\n".join(lines) + "\n")
    else:
        sys.stdout.write(f"{shape.phrase()} fits nowhere now: {why}\n")
    return 0 if cards else 1


__all__ = ["Shape", "fitting", "parse_shape", "render_top", "run_fit", "run_top", "why_none"]
