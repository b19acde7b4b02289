"""The abuse benchmark's large bodies are what it claims: exactly the size asked for, and a
valid AdmissionReview of a GPU pod (so the server parses and reviews them in full)."""

from __future__ import annotations

import pytest

from bench.webhook_abuse import MIB, large_review
from core.admission import AdmissionReview


@pytest.mark.parametrize("mib", [pytest.param(1, id="1MiB"), pytest.param(8, id="8MiB")])
def test_large_reviews_have_the_size_asked_for(mib: int) -> None:
    assert len(large_review(mib * MIB)) == mib * MIB


def test_a_large_review_is_a_pod_review() -> None:
    review = AdmissionReview.parse(large_review(2 * MIB))
    assert review.request is not None
    assert review.request.kind.kind == "Pod"


@pytest.mark.parametrize("dense", [False, True], ids=["env", "dense"])
def test_large_reviews_have_the_size_asked_for_in_either_form(dense: bool) -> None:
    body = large_review(2 * MIB, dense=dense)
    assert len(body) == 2 * MIB
    review = AdmissionReview.parse(body)
    assert review.request is not None
    assert review.request.kind.kind == "Pod"
