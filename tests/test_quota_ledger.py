"""The quota arithmetic, property-based: whatever is reserved, no scope ever exceeds its limit."""

from hypothesis import given
from hypothesis import strategies as st

from quota.demand import Demand
from quota.ledger import Ledger, Reservation, Usage
from quota.model import GPUQuota, LimitSpec, QuotaSpec
from tests.quota_pods import gpu_quota

MODELS = ["A100", "T4"]

limits = st.builds(
    LimitSpec,
    gpu=st.none() | st.integers(0, 1000),
    gpumem=st.none() | st.integers(0, 200_000),
    pods=st.none() | st.integers(0, 20),
)
specs = st.builds(
    QuotaSpec,
    gpu=st.none() | st.integers(0, 1000),
    gpumem=st.none() | st.integers(0, 200_000),
    pods=st.none() | st.integers(0, 20),
    models=st.dictionaries(st.sampled_from(MODELS), limits, max_size=2),
)
demands = st.builds(
    Demand,
    core=st.integers(1, 400),
    memory_mib=st.integers(1, 320).map(lambda b: b * 256),
    models=st.none() | st.frozensets(st.sampled_from([*MODELS, "H100"]), min_size=1),
)


def _within_everywhere(ledger: Ledger) -> bool:
    return all(ledger.charged(model).within(limit) for model, limit in ledger.scopes())


@given(specs, st.lists(demands, max_size=40))
def test_reservations_never_exceed_any_scope(spec: QuotaSpec, asks: list[Demand]) -> None:
    ledger = Ledger("ns", "q", spec)
    for index, demand in enumerate(asks):
        before = dict(ledger.reservations)
        violation = ledger.reserve(Reservation(f"uid-{index}", f"p{index}", demand))
        if violation is None:
            assert f"uid-{index}" in ledger.reservations
        else:
            assert ledger.reservations == before
            # The violation is real: that scope would be over its limit with the pod.
            assert not (violation.charged + Usage.of(demand)).within(violation.limit)
        assert _within_everywhere(ledger)


@given(specs, st.lists(demands, max_size=30), st.data())
def test_release_and_recount_are_exact(
    spec: QuotaSpec, asks: list[Demand], data: st.DataObject
) -> None:
    ledger = Ledger("ns", "q", spec)
    for index, demand in enumerate(asks):
        ledger.reserve(Reservation(f"uid-{index}", f"p{index}", demand))
    held = list(ledger.reservations)
    gone = data.draw(st.lists(st.sampled_from(held), unique=True) if held else st.just([]))
    ledger.release(gone)
    kept = [ledger.reservations[uid].demand for uid in held if uid not in gone]
    assert ledger.charged(None) == sum((Usage.of(d) for d in kept), Usage())
    # The controller confirming them all moves them from reserved to used: same charge.
    charged = {model: ledger.charged(model) for model, _ in ledger.scopes()}
    ledger.set_used(kept)
    ledger.release(list(ledger.reservations))
    assert {model: ledger.charged(model) for model, _ in ledger.scopes()} == charged


def test_reserve_is_idempotent_per_uid() -> None:
    ledger = Ledger.of(GPUQuota(gpu_quota(gpu=1)))
    reservation = Reservation("u1", "p", Demand(60, 256))
    assert ledger.reserve(reservation) is None
    assert ledger.reserve(reservation) is None  # a repeated review is not charged twice
    assert ledger.charged(None).core == 60
    assert ledger.reserve(Reservation("u2", "p2", Demand(60, 256))) is not None


def test_status_round_trip() -> None:
    quota = GPUQuota(gpu_quota(gpu=4, gpumem="64Gi", models={"A100": {"gpu": 2}}))
    ledger = Ledger.of(quota)
    ledger.set_used([Demand(100, 1024, frozenset({"A100"})), Demand(50, 512)])
    ledger.reserve(Reservation("u", "p", Demand(30, 256, frozenset({"T4"}))))
    again = Ledger.of(quota.with_status(ledger.status(quota.status)))
    assert again == ledger
    status = quota.with_status(ledger.status(quota.status)).raw["status"]
    assert status["used"]["cards"] == "1.50"
    assert status["used"]["models"]["A100"]["core"] == 150  # the unpinned pod may land there
    assert status["reserved"] == {"cards": "0.30", "core": 30, "memoryMiB": 256, "pods": 1}
