"""Denial messages: exactly the documented format, extended for models and pod counts."""

from datetime import UTC, datetime

from quota.demand import Demand
from quota.ledger import Ledger, Usage, Violation
from quota.messages import exceeded, no_quota, unverifiable
from quota.model import GPUQuota, LimitSpec
from testkit.quota_pods import gpu_quota


def _violation(spec: dict[str, object], used: list[Demand], ask: Demand) -> str:
    ledger = Ledger.of(GPUQuota(gpu_quota(**spec)))
    ledger.recount({str(i): d for i, d in enumerate(used)}, [], None)
    violation = ledger.check(ask)
    assert violation is not None
    return exceeded(violation)


def test_design_example_exactly() -> None:
    used = [Demand(370, 61440)]
    message = _violation({"gpu": 4, "gpumem": "64Gi"}, used, Demand(50, 8192))
    assert message == (
        'GPU quota exceeded in namespace "team-a": this pod asks 0.50 card and 8192 MiB; '
        'quota "team-a" allows 4.00 cards (3.70 used) and 65536 MiB (61440 used)'
    )


def test_pending_admissions_count_as_used() -> None:
    ledger = Ledger.of(GPUQuota(gpu_quota(gpu="1")))
    ledger.admit("u", "p", Demand(80, 256), datetime.now(UTC))
    violation = ledger.check(Demand(30, 256))
    assert violation is not None
    assert exceeded(violation).endswith('quota "team-a" allows 1.00 card (0.80 used)')


def test_pods_and_models() -> None:
    message = _violation({"pods": 2}, [Demand(10, 256), Demand(10, 256)], Demand(10, 256))
    assert message.endswith('quota "team-a" allows 2 GPU pods (2 used)')
    message = _violation(
        {"models": {"A100": {"gpu": 1}}}, [Demand(80, 256, frozenset({"A100"}))], Demand(30, 256)
    )
    assert 'quota "team-a" allows 1.00 card of A100 (0.80 used)' in message
    assert "not pinned to a GPU model" in message
    assert "nodeSelector fracgpu.io/gpu.product" in message


def test_other_messages() -> None:
    assert no_quota("team-b", Demand(100, 1024)).startswith(
        'GPU quota required in namespace "team-b": this pod asks 1.00 card and 1024 MiB'
    )
    text = unverifiable("team-a", Demand(50, 256), "the Kubernetes API server did not answer")
    assert text.startswith('GPU quota could not be verified in namespace "team-a"')
    assert "never admitted unaccounted" in text


def test_whole_cards_that_cannot_be_sized_say_why_and_how_to_fix_it() -> None:
    demand = Demand(200, 0, unsized_cards=2)
    violation = Violation("team-a", "gpus", None, LimitSpec(gpumem=65536), Usage(), demand)
    assert exceeded(violation) == (
        'GPU quota cannot count this pod in namespace "team-a": it asks 2 whole cards, which '
        "come with all of their memory, and no GPU node of a model it may land on is known yet, "
        'while quota "gpus" limits GPU memory to 65536 MiB; create the pod again once a GPU node '
        "has joined, or pin a GPU model with nodeSelector fracgpu.io/gpu.product that the "
        "webhook's inventory.models names"
    )
