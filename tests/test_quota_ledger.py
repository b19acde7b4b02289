"""The quota arithmetic, property-based: whatever is admitted, no scope ever exceeds its limit,
and the status stays bounded."""

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from quota.demand import Demand
from quota.ledger import Ledger, Usage
from quota.model import GPUQuota, LimitSpec, QuotaSpec
from testkit.quota_pods import gpu_quota

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


AT = datetime(2026, 1, 1, tzinfo=UTC)


def _within_everywhere(ledger: Ledger) -> bool:
    return all(ledger.charged(model).within(limit) for model, limit in ledger.scopes())


def _charges(ledger: Ledger) -> dict[str | None, Usage]:
    return {model: ledger.charged(model) for model, _ in ledger.scopes()}


@given(specs, st.lists(demands, max_size=40), st.integers(1, 8))
def test_admissions_never_exceed_any_scope(spec: QuotaSpec, asks: list[Demand], limit: int) -> None:
    ledger = Ledger("ns", "q", spec, pending_limit=limit)
    for index, demand in enumerate(asks):
        before = _charges(ledger)
        violation = ledger.admit(f"uid-{index}", f"p{index}", demand, AT)
        if violation is not None:
            assert _charges(ledger) == before
            # The violation is real: that scope would be over its limit with the pod.
            assert not (violation.charged + Usage.of(demand)).within(violation.limit)
        assert _within_everywhere(ledger)
        assert len(ledger.pending) <= limit  # the object stays bounded


@given(specs, st.lists(demands, max_size=30), st.integers(1, 8), st.data())
def test_withdraw_and_recount_are_exact(
    spec: QuotaSpec, asks: list[Demand], limit: int, data: st.DataObject
) -> None:
    ledger = Ledger("ns", "q", spec, pending_limit=limit)
    admitted = {}
    for index, demand in enumerate(asks):
        if ledger.admit(f"uid-{index}", f"p{index}", demand, AT) is None:
            admitted[f"uid-{index}"] = demand
    held = [entry.uid for entry in ledger.pending]
    gone = data.draw(st.lists(st.sampled_from(held), unique=True) if held else st.just([]))
    ledger.withdraw(gone)
    kept = {uid: d for uid, d in admitted.items() if uid not in gone}
    assert ledger.charged(None) == sum((Usage.of(d) for d in kept.values()), Usage())
    # Every kept pod appears: the recount charges exactly what admission charged.
    charged = _charges(ledger)
    ledger.recount(kept, [], None)
    assert _charges(ledger) == charged
    assert ledger.pending == []


@pytest.mark.parametrize(
    ("limit", "pending", "unmatched_pods"),
    [
        pytest.param(32, 3, 0, id="under-the-limit-all-pending"),
        pytest.param(2, 2, 1, id="over-the-limit-oldest-folded"),
    ],
)
def test_pending_is_bounded_and_folding_keeps_the_charge(
    limit: int, pending: int, unmatched_pods: int
) -> None:
    ledger = Ledger.of(GPUQuota(gpu_quota(gpu=4, models={"A100": {"gpu": 2}})), pending_limit=limit)
    for index in range(3):
        at = AT + timedelta(seconds=index)
        assert ledger.admit(f"u{index}", f"p{index}", Demand(50, 256), at) is None
    assert [entry.uid for entry in ledger.pending] == [f"u{i}" for i in range(3 - pending, 3)]
    assert ledger.unmatched.total.pods == unmatched_pods
    assert ledger.charged(None).core == 150
    assert ledger.charged("A100").core == 150


def test_admit_is_idempotent_per_uid() -> None:
    ledger = Ledger.of(GPUQuota(gpu_quota(gpu=1)))
    assert ledger.admit("u1", "p", Demand(60, 256), AT) is None
    assert ledger.admit("u1", "p", Demand(60, 256), AT) is None  # a repeated review
    assert ledger.charged(None).core == 60
    assert ledger.admit("u2", "p2", Demand(60, 256), AT) is not None


def test_status_round_trip() -> None:
    quota = GPUQuota(gpu_quota(gpu=4, gpumem="64Gi", models={"A100": {"gpu": 2}}))
    ledger = Ledger.of(quota, pending_limit=1)
    ledger.recount({"a": Demand(100, 1024, frozenset({"A100"})), "b": Demand(50, 512)}, [], None)
    ledger.admit("u", "p", Demand(30, 256, frozenset({"T4"})), AT)
    ledger.admit("v", "q", Demand(10, 256), AT)
    again = Ledger.of(quota.with_status(ledger.status(quota.status)), pending_limit=1)
    assert again == ledger
    status = quota.with_status(ledger.status(quota.status)).raw["status"]
    assert status["used"]["cards"] == "1.90"
    assert status["used"]["models"]["A100"]["core"] == 160  # unpinned pods may land there
    assert status["unmatched"]["core"] == 30
    assert [entry["uid"] for entry in status["pending"]] == ["v"]


def test_status_of_the_previous_release_keeps_its_reservations() -> None:
    old = gpu_quota(gpu=4)
    old["status"] = {
        "used": {"cards": "1.00", "core": 100, "memoryMiB": 1024, "pods": 1},
        "reserved": {"core": 30},
        "reservations": {"u1": {"pod": "p1", "core": 30, "memoryMiB": 256}},
    }
    quota = GPUQuota(old)
    assert Ledger.of(quota).charged(None) == Usage(130, 1280, 2)
    assert [entry.uid for entry in quota.status.pending] == ["u1"]
    assert not quota.counted()  # counted again by the controller before admission uses it


@pytest.mark.parametrize(
    ("name", "kept"),
    [
        pytest.param("train-0", "train-0", id="short-name-as-is"),
        pytest.param("x" * 250 + "<generated>", "x" * 250 + "<ge", id="display-name-cut-to-253"),
    ],
)
def test_pending_pod_names_fit_the_crd(name: str, kept: str) -> None:
    ledger = Ledger.of(GPUQuota(gpu_quota(gpu=1)))
    ledger.admit("u", name, Demand(10, 256), AT)
    assert ledger.pending[0].wire().pod == kept


@pytest.mark.parametrize(
    ("spec", "refused"),
    [
        pytest.param(QuotaSpec(gpu=800), False, id="no memory limit: cards count"),
        pytest.param(QuotaSpec(gpu=800, gpumem=1_000_000), True, id="memory limit: refused"),
        pytest.param(
            QuotaSpec(models={"T4": LimitSpec(gpumem=100_000)}),
            True,
            id="a per-model memory limit the pod counts against",
        ),
        pytest.param(
            QuotaSpec(models={"T4": LimitSpec(gpumem=100_000)}),
            False,
            id="a per-model limit of another model",
        ),
    ],
)
def test_unsized_whole_cards_are_refused_only_where_memory_is_limited(
    spec: QuotaSpec, refused: bool, request: pytest.FixtureRequest
) -> None:
    pinned = frozenset({"A100"}) if "another model" in request.node.callspec.id else None
    demand = Demand(200, 0, pinned, unsized_cards=2)
    violation = Ledger("ns", "q", spec).admit("uid", "p", demand, AT)
    assert (violation is not None) is refused
