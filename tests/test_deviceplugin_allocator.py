"""The allocator's arithmetic: honesty, preferences, pairing, validation, reconciliation."""

from __future__ import annotations

import pytest

from deviceplugin.classic.allocation import Allocation, AllocationError, container_dir_name
from deviceplugin.classic.allocator import Allocator
from deviceplugin.classic.ids import Kind, core_id, memory_id
from deviceplugin.classic.pairing import WHOLE_CORE_PAIR_S
from deviceplugin.classic.settling import SETTLE_S
from deviceplugin.shared.inventory import Card

CORE = "fracgpu.io/core"
MEMORY = "fracgpu.io/memory"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(count: int = 2, memory_mib: int = 4096, numa: list[int | None] | None = None) -> Allocator:
    nodes = numa or [None] * count
    cards = [Card(i, f"GPU-{i}", "Fake", memory_mib, i, nodes[i]) for i in range(count)]
    # no settling moment: these tests look at what the policy offers (see the test of it)
    return Allocator(cards, clock=Clock(), wall=Clock(), settle_s=0.0)


def healthy(alloc: Allocator, kind: Kind) -> set[str]:
    return {d.id for d in alloc.devices(kind) if d.healthy}


def free(alloc: Allocator, kind: Kind) -> list[str]:
    used = {i for a in alloc.allocations() for i in a.ids()}
    return [i for i in healthy(alloc, kind) if i not in used]


def take(alloc: Allocator, core: int, memory: int, *, memory_first: bool = False) -> list[str]:
    """A container's two calls as kubelet makes them: preference, then Allocate, per resource."""
    order = [(Kind.MEMORY, memory), (Kind.CORE, core)]
    if not memory_first:
        order.reverse()
    ids: list[str] = []
    for kind, size in order:
        chosen = alloc.preferred(kind, free(alloc, kind), [], size)
        assert len(chosen) == size
        alloc.allocate(kind, chosen, CORE if kind is Kind.CORE else MEMORY)
        ids += chosen
    return ids


def placed(alloc: Allocator, ids: list[str]) -> set[int]:
    """The cards the container holding ``ids`` was placed on (its IDs name none)."""
    core = [i for i in ids if "-c" in i]
    found = alloc.find(Kind.CORE, core) if core else alloc.find(Kind.MEMORY, ids)
    assert found is not None
    return set(found.cards)


def test_ids_are_short_and_advertised_per_card() -> None:
    alloc = make(2, 4096)
    assert len(alloc.devices(Kind.CORE)) == 200
    assert len(alloc.devices(Kind.MEMORY)) == 32  # 4096 MiB / 256
    assert max(len(d.id) for d in alloc.devices(Kind.MEMORY)) <= 63


@pytest.mark.parametrize("memory_first", [False, True], ids=["core-first", "memory-first"])
def test_a_container_is_placed_on_one_card_in_either_order(memory_first: bool) -> None:
    alloc = make(3)
    for _ in range(5):
        ids = take(alloc, 30, 4, memory_first=memory_first)
        assert len(placed(alloc, ids)) == 1
    assert [(u.core_used, u.memory_used) for u in alloc.usage()] == [(90, 12), (60, 8), (0, 0)]


def test_fractions_pack_best_fit() -> None:
    alloc = make(2)
    first = take(alloc, 60, 4)
    second = take(alloc, 40, 4)  # fits exactly beside the first
    assert placed(alloc, first) == placed(alloc, second)
    third = take(alloc, 50, 4)
    assert placed(alloc, third) != placed(alloc, first)


def test_exhausted_core_strands_free_memory_and_the_reverse() -> None:
    alloc = make(1, 4096)  # 100 core, 16 blocks
    take(alloc, 60, 2)
    take(alloc, 40, 2)
    assert free(alloc, Kind.MEMORY) == []  # 12 blocks free, but no core left to use them
    assert len(healthy(alloc, Kind.MEMORY)) == 4  # allocated IDs stay Healthy
    other = make(1, 4096)
    take(other, 10, 16)
    assert free(other, Kind.CORE) == []
    assert len(healthy(other, Kind.CORE)) == 10


def test_pending_half_keeps_its_partner_allocatable() -> None:
    alloc = make(1, 4096)
    chosen = alloc.preferred(Kind.CORE, free(alloc, Kind.CORE), [], 100)
    alloc.allocate(Kind.CORE, chosen, CORE)
    # Between the container's two Allocates its memory must still be offered.
    assert len(free(alloc, Kind.MEMORY)) == 16
    alloc.allocate(Kind.MEMORY, [memory_id(0, n) for n in range(16)], MEMORY)
    assert len(alloc.allocations()) == 1


def test_pending_half_expires() -> None:
    clock = Clock()
    alloc = Allocator(
        [Card(0, "GPU-0", "Fake", 4096, 0, None)], clock=clock, wall=Clock(), settle_s=0.0
    )
    alloc.allocate(Kind.CORE, [core_id(0, n) for n in range(100)], CORE)
    assert len(free(alloc, Kind.MEMORY)) == 16
    clock.now += alloc.pair_window_s + 1
    assert free(alloc, Kind.MEMORY) == []


def test_whole_cards_prefer_one_numa_node() -> None:
    alloc = make(4, numa=[0, 0, 1, 1])
    take(alloc, 30, 2)  # lands on card 0 (best fit among equals: lowest index)
    ids = take(alloc, 200, 32)
    assert placed(alloc, ids) == {2, 3}


def test_whole_card_request_spanning_numa_when_it_must() -> None:
    alloc = make(4, numa=[0, 0, 1, 1])
    take(alloc, 30, 2)
    ids = take(alloc, 300, 48)
    assert placed(alloc, ids) == {1, 2, 3}


def test_ids_are_counts_whatever_groups_kubelet_draws_them_from() -> None:
    """IDs named after two cards, core from one and memory from another: one share, placed
    on one card by the ledger (kubelet's choice used to fail such a pod)."""
    alloc = make(2)
    split = [core_id(0, n) for n in range(20)] + [core_id(1, n) for n in range(20)]
    alloc.allocate(Kind.CORE, split, CORE)
    allocation = alloc.allocate(Kind.MEMORY, [memory_id(1, 0), memory_id(0, 3)], MEMORY)
    assert allocation.cards == (0,)
    assert [(u.core_used, u.memory_used) for u in alloc.usage()] == [(40, 2), (0, 0)]


def test_more_than_a_card_that_is_not_whole_cards_is_refused() -> None:
    ids = [core_id(c, n) for c in range(2) for n in range(100)][:150]
    with pytest.raises(AllocationError, match="neither a share"):
        make(2).allocate(Kind.CORE, ids, CORE)


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        pytest.param([], "no device IDs", id="empty"),
        pytest.param(["gpu0"], "not a fracgpu ID", id="not-a-fracgpu-id"),
        pytest.param(["g9-c1"], "unknown on this node", id="unknown-card"),
        pytest.param(["g0-c100"], "unknown on this node", id="unit-beyond-the-card"),
        pytest.param(["g0-m1"], "other fracgpu resource", id="memory-id-for-core"),
        pytest.param(["g0-c1", "g0-c1"], "twice", id="same-id-twice"),
    ],
)
def test_bad_ids_are_refused_with_the_reason(ids: list[str], message: str) -> None:
    with pytest.raises(AllocationError, match=message):
        make(1).allocate(Kind.CORE, ids, CORE)


def test_unhealthy_card_lists_every_id_unhealthy_and_recovers() -> None:
    alloc = make(2)
    before = alloc.version
    assert alloc.set_health(1, False, "XID 79")
    assert alloc.version > before
    assert not any(d.healthy for d in alloc.devices(Kind.CORE) if d.id.startswith("g1-"))
    assert not alloc.set_health(1, False, "again")  # no change, no resend
    alloc.set_health(1, True)
    assert len(healthy(alloc, Kind.CORE)) == 200


def test_reconcile_frees_gone_containers_and_adopts_unknown_ones() -> None:
    alloc = make(2)
    gone = take(alloc, 30, 2)
    kept = take(alloc, 30, 2)
    core = [i for i in kept if "-c" in i]
    memory = [i for i in kept if "-m" in i]
    stranger = ([core_id(1, n) for n in range(5)], [memory_id(1, 0)])
    freed = alloc.reconcile(
        [(core, memory), stranger], listed_at=5000.0, grace_s=1.0, confirm_s=0.0
    ).freed
    assert [set(a.ids()) for a in freed] == [set(gone)]
    assert {a.dir_name for a in alloc.allocations()} == {
        container_dir_name(core),
        container_dir_name(stranger[0]),
    }


def test_reconcile_spares_allocations_younger_than_the_grace_period() -> None:
    alloc = make(1)
    take(alloc, 30, 2)
    assert alloc.reconcile([], listed_at=1000.5, grace_s=10.0, confirm_s=0.0).freed == []
    assert len(alloc.allocations()) == 1


def test_kubelet_reusing_ids_replaces_a_stale_allocation() -> None:
    alloc = make(1)
    take(alloc, 100, 16)
    ids = [core_id(0, n) for n in range(50)]
    alloc.allocate(Kind.CORE, ids, CORE)  # the earlier pod ended before reconciliation
    assert [a.core for a in alloc.allocations()] == [tuple(ids)]


def _two_cards_at_sixty() -> tuple[Allocator, list[str], list[str]]:
    """Two 16-block cards, each 0.6 used by one container (x on one card, y on the other)."""
    alloc = make(2)
    x = take(alloc, 60, 8)
    y = take(alloc, 60, 8)
    assert placed(alloc, x) != placed(alloc, y)
    return alloc, x, y


def test_an_ended_containers_ids_offered_by_kubelet_are_freed_at_once() -> None:
    """x's pod ended and kubelet, which is the authority on what is free, offers x's IDs to
    the next container before the reconciler noticed: the plugin frees x at once, and the
    0.5 share fits on x's card, where the plugin's old records would have refused it."""
    alloc, x, y = _two_cards_at_sixty()
    x_card = placed(alloc, x)
    before = alloc.version
    available = sorted(healthy(alloc, Kind.CORE) - set(y))  # kubelet: healthy minus in use
    chosen = alloc.preferred(Kind.CORE, available, [], 50)
    assert len(chosen) == 50
    assert [set(a.core) for a in alloc.allocations()] == [{i for i in y if "-c" in i}]
    assert alloc.version > before  # the lists change now, and the Node's allocatable with them
    alloc.allocate(Kind.CORE, chosen, CORE)
    share = alloc.allocate(Kind.MEMORY, free(alloc, Kind.MEMORY)[:4], MEMORY)
    assert set(share.cards) == x_card  # the only card 0.5 fits, now that x has ended


def test_an_init_containers_ids_offered_for_reuse_are_not_freed() -> None:
    """kubelet offers an init container's IDs again to its pod's app container
    (``must_include``): that allocation is not an ended one."""
    alloc, x, _ = _two_cards_at_sixty()
    x_core = [i for i in x if "-c" in i]
    available = sorted(healthy(alloc, Kind.CORE))
    alloc.preferred(Kind.CORE, available, x_core, 60)
    assert any(set(a.core) == set(x_core) for a in alloc.allocations())


def test_a_refused_allocate_still_frees_what_kubelet_reassigned() -> None:
    """kubelet assigns some of an ended container's IDs to a request that can never work (a
    pod that bypassed admission): the plugin refuses, and lists the ended container's IDs as
    free at once."""
    alloc, x, y = _two_cards_at_sixty()
    before = alloc.version
    x_core = [i for i in x if "-c" in i]
    rest = [d.id for d in alloc.devices(Kind.CORE) if d.id not in set(x) | set(y)]
    with pytest.raises(AllocationError, match="neither a share"):
        alloc.allocate(Kind.CORE, x_core + rest, CORE)  # 140
    assert [set(a.core) for a in alloc.allocations()] == [{i for i in y if "-c" in i}]
    assert alloc.version > before


def test_container_dir_name_depends_only_on_the_set_of_ids() -> None:
    assert container_dir_name(["g0-c2", "g0-c1"]) == container_dir_name(["g0-c1", "g0-c2"])
    assert container_dir_name(["g0-c1"]) != container_dir_name(["g0-c2"])


def test_reconcile_replaces_a_record_whose_ids_kubelet_gave_to_another_container() -> None:
    alloc = make(1)
    take(alloc, 30, 4)
    # While the plugin was not looking, the pod ended and a new container got part of its IDs.
    core = [core_id(0, n) for n in range(10)]
    memory = [memory_id(0, 0)]
    alloc.reconcile([(core, memory)], listed_at=5000.0, grace_s=1.0, confirm_s=0.0)
    assert [(set(a.core), set(a.memory)) for a in alloc.allocations()] == [(set(core), set(memory))]


# (case, the listing given the two recorded containers a and b, the containers left afterwards)
RECONCILE_CASES = [
    ("both as recorded", lambda a, b: [a, b], lambda a, b: [a, b]),
    ("listed in another order", lambda a, b: [(b[0][::-1], b[1]), a], lambda a, b: [a, b]),
    ("one container gone", lambda a, b: [a], lambda a, b: [a]),
    (
        "a listed with fewer IDs than recorded",
        lambda a, b: [(a[0][:3], a[1]), b],
        lambda a, b: [(a[0][:3], a[1]), b],
    ),
    (
        "a listed with one of b's IDs as well",
        lambda a, b: [(a[0] + b[0][:1], a[1])],
        lambda a, b: [(a[0] + b[0][:1], a[1])],
    ),
    ("a listed with its core only", lambda a, b: [(a[0], []), b], lambda a, b: [(a[0], []), b]),
    ("memory only", lambda a, b: [([], a[1]), b], lambda a, b: [([], a[1]), b]),
]


@pytest.mark.parametrize(
    ("listing", "after"),
    [pytest.param(listing, after, id=case) for case, listing, after in RECONCILE_CASES],
)
def test_reconcile_leaves_exactly_what_kubelet_lists(listing: object, after: object) -> None:
    alloc = make(2)
    ids = [take(alloc, 20, 2), take(alloc, 20, 2)]
    a, b = (([i for i in x if "-c" in i], [i for i in x if "-m" in i]) for x in ids)
    listed = listing(a, b)  # type: ignore[operator]
    before, keys = alloc.version, {x.key for x in alloc.allocations()}
    alloc.reconcile(listed, listed_at=5000.0, grace_s=1.0, confirm_s=0.0)
    expected = {(frozenset(c), frozenset(m)) for c, m in after(a, b)}  # type: ignore[operator]
    assert {(frozenset(x.core), frozenset(x.memory)) for x in alloc.allocations()} == expected
    owned = {i for x in alloc.allocations() for i in x.ids()}
    assert owned == {i for c, m in expected for i in (*c, *m)}
    assert all(alloc.find(Kind.CORE, x.core) is x for x in alloc.allocations() if x.core)
    if expected == {(frozenset(c), frozenset(m)) for c, m in (a, b)}:
        # listed as recorded, in whatever order: a quiet pass keeps every record as it is
        assert alloc.version == before
        assert {x.key for x in alloc.allocations()} == keys


@pytest.mark.parametrize("claimed", ["memory", "core"])
def test_reconcile_repairs_records_that_share_ids(claimed: str) -> None:
    """A checkpoint restored with two records claiming one ID: kubelet's listing settles it."""
    alloc = make(1)
    core = [core_id(0, n) for n in range(4)]
    memory = [memory_id(0, 0)]
    first = Allocation(tuple(core), tuple(memory), (0,), 0.0)
    second = Allocation((), tuple(memory), (0,), 0.0)
    if claimed == "core":
        second = Allocation((core[2],), (), (0,), 0.0)
    alloc.restore([first, second])  # the second now owns one of the first's IDs
    alloc.reconcile([(core, memory)], listed_at=5000.0, grace_s=1.0, confirm_s=0.0)
    (only,) = alloc.allocations()
    assert (set(only.core), set(only.memory)) == (set(core), set(memory))
    assert all(
        alloc.find(kind, [i]) is only
        for kind, i in [*((Kind.CORE, i) for i in core), (Kind.MEMORY, memory[0])]
    )


def test_memory_first_a_share_lands_where_its_core_fits_too() -> None:
    """Memory first, a share whose core does not fit the partly used card: it is placed once
    both amounts are known, on the card where both fit (this first pod of its shape used to
    fail)."""
    alloc = make(2, 24 * 1024)  # 96 blocks per card
    take(alloc, 70, 10)  # card 0: 30 core and 86 blocks left; card 1 free
    ids = take(alloc, 50, 10, memory_first=True)
    assert placed(alloc, ids) == {1}


@pytest.mark.parametrize(
    ("memory", "paired"),
    [
        pytest.param([memory_id(0, n) for n in range(16)], True, id="all its memory: one pod"),
        pytest.param([memory_id(1, 0)], False, id="another container's memory"),
    ],
)
def test_whole_cards_core_pairs_only_with_all_of_their_memory(
    memory: list[str], paired: bool
) -> None:
    """Whole cards come without memory: a memory call after them may be the next container's."""
    alloc = make(2, 4096)
    alloc.allocate(Kind.CORE, [core_id(0, n) for n in range(100)], CORE)
    alloc.allocate(Kind.MEMORY, memory, MEMORY)
    assert len(alloc.allocations()) == (1 if paired else 2)


def test_whole_cards_core_lists_their_memory_only_for_a_moment() -> None:
    clock = Clock()
    alloc = Allocator(
        [Card(0, "GPU-0", "Fake", 4096, 0, None)], clock=clock, wall=Clock(), settle_s=0.0
    )
    alloc.allocate(Kind.CORE, [core_id(0, n) for n in range(100)], CORE)
    assert len(free(alloc, Kind.MEMORY)) == 16  # in case a memory call follows at once
    clock.now += WHOLE_CORE_PAIR_S
    assert free(alloc, Kind.MEMORY) == []  # no one else can use it: the core is taken
    (whole,) = alloc.allocations()
    assert whole.whole_cards_only


# (listings as (seconds, whether kubelet has settled), whether the allocation is freed after them)
CONFIRMATIONS = [
    pytest.param([(0.0, True)], False, id="one listing that misses it"),
    pytest.param([(0.0, True), (0.2, True)], False, id="a second one too soon"),
    pytest.param([(0.0, True), (0.5, True)], True, id="a second one 0.5 s later"),
    pytest.param([(0.0, True), (1.0, False)], False, id="the second while kubelet settles"),
    pytest.param(
        [(0.0, False), (30.0, True)], False, id="a listing while settling confirms nothing"
    ),
    pytest.param([(0.0, False), (30.0, True), (30.5, True)], True, id="two after settling"),
]


@pytest.mark.parametrize(("listings", "freed"), CONFIRMATIONS)
def test_a_missing_container_is_freed_once_a_second_listing_confirms(
    listings: list[tuple[float, bool]], freed: bool
) -> None:
    alloc = make(1)
    take(alloc, 30, 2)
    for at, settled in listings:
        alloc.reconcile([], 5000.0 + at, grace_s=1.0, confirm_s=0.5, may_free=settled)
    assert (alloc.allocations() == []) is freed


def test_a_change_that_hides_capacity_keeps_the_lists_for_a_moment() -> None:
    """A 0.5 share that must take the free card hides the open card's 0.4: the Node's
    allocatable keeps what was counted for SETTLE_S, kubelet's lists for twice as long (a pod
    the scheduler bound by the older figure is admitted, and waits for a card if none fits),
    then both offer what the ledger offers."""
    clock = Clock()
    cards = [Card(i, f"GPU-{i}", "Fake", 4096, i, None) for i in range(2)]
    alloc = Allocator(cards, clock=clock, wall=clock)
    take(alloc, 60, 8)  # card 0: 0.4 left, the open card; card 1 entirely free
    assert len(healthy(alloc, Kind.CORE)) == 200
    take(alloc, 50, 4)  # only card 1 fits it; card 1 (0.5 left) is the open card now
    assert len(healthy(alloc, Kind.CORE)) == 200  # 110 allocated, 90 free still listed
    assert alloc.settling(Kind.CORE)
    assert alloc.over_offered(Kind.CORE) == 0  # the Node keeps it too, for now
    version = alloc.version
    clock.now += SETTLE_S
    assert alloc.wait_for_change(version, 0) != version  # the Node's writer wakes
    assert len(healthy(alloc, Kind.CORE)) == 200
    assert alloc.over_offered(Kind.CORE) == 40  # the Node's allocatable leaves it out now
    version = alloc.version
    clock.now += SETTLE_S
    assert alloc.wait_for_change(version, 0) != version  # the streams wake to resend
    assert len(healthy(alloc, Kind.CORE)) == 110 + 50  # card 0's rest is hidden now
    assert not alloc.settling(Kind.CORE)
    assert alloc.over_offered(Kind.CORE) == 0
    alloc.set_health(1, False, "XID 79")
    assert len(free(alloc, Kind.CORE)) == 40  # a failing card is withdrawn at once
