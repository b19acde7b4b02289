"""A namespace-wide quota decision told to one pod (quota.decision)."""

from __future__ import annotations

import pytest

from quota import messages
from quota.decision import Decision, explain, unverifiable
from quota.demand import Demand

ASK = Demand(50, 256)


@pytest.mark.parametrize(
    ("decision", "expected"),
    [
        pytest.param(
            Decision(False, reason="no-quota"),
            Decision(False, messages.no_quota("ns", ASK), "no-quota"),
            id="quota-required-but-none",
        ),
        pytest.param(
            Decision(True, reason="no-quota"),
            Decision(True, reason="no-quota"),
            id="no-quota-allowed-as-is",
        ),
        pytest.param(
            Decision(False, "spec.gpu is bad", "invalid-quota"),
            Decision(False, messages.invalid_quota("ns", "spec.gpu is bad"), "invalid-quota"),
            id="invalid-quota",
        ),
        pytest.param(
            Decision(False, reason="no-crd"),
            Decision(False, messages.crd_missing("ns", ASK), "no-crd"),
            id="crd-missing",
        ),
        pytest.param(
            Decision(False, "new quota", "not-counted"),
            Decision(False, messages.not_counted_for("ns", ASK, "new quota"), "not-counted"),
            id="not-counted",
        ),
        pytest.param(
            Decision(False, "other", "exceeded"),
            Decision(False, "other", "exceeded"),
            id="anything-else-unchanged",
        ),
    ],
)
def test_explain_phrases_a_namespace_wide_decision_for_the_pod(
    decision: Decision, expected: Decision
) -> None:
    assert explain("ns", ASK, decision) == expected


def test_unverifiable_denies_and_says_why() -> None:
    decision = unverifiable("ns", ASK, "the API server is down")
    assert decision == Decision(
        False, messages.unverifiable("ns", ASK, "the API server is down"), "unverifiable"
    )
