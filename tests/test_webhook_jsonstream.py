"""Large bodies are parsed in pieces (webhook.jsonstream); ordinary ones in one call (pydantic).
Both must make the same AdmissionReview of the same body, or both refuse it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.admission import AdmissionReview, ReviewError
from webhook.jsonstream import MAX_DEPTH, JSONError, JSONStream

EXAMPLE = (Path(__file__).parent.parent / "examples" / "admissionreview-pod.json").read_bytes()


def in_pieces(body: bytes, size: int) -> Any:
    stream = JSONStream()
    for start in range(0, len(body), size):
        stream.feed(body[start : start + size])
    return stream.close()


def review_in_pieces(body: bytes, size: int) -> AdmissionReview:
    """What the server does with a large body."""
    try:
        value = in_pieces(body, size)
    except JSONError as exc:
        raise ReviewError(f"not an AdmissionReview: body: Invalid JSON: {exc}") from None
    return AdmissionReview.from_value(value)


def outcome(parse: Any, body: bytes) -> tuple[str, Any]:
    try:
        return "review", parse(body).model_dump()
    except ReviewError:
        return "refused", None


def envelope(obj: str) -> bytes:
    """An AdmissionReview of a pod whose ``object`` is ``obj`` (JSON text)."""
    return (
        '{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":'
        '{"uid":"u1","kind":{"kind":"Pod"},"operation":"CREATE","object":' + obj + "}}"
    ).encode()


def nested(depth: int) -> bytes:
    """An AdmissionReview nested ``depth`` levels deep in all (itself, request, object, ...)."""
    inner = depth - 3
    return envelope('{"x":' + "[" * inner + "]" * inner + "}")


SAME = [
    pytest.param(EXAMPLE, id="the example pod"),
    pytest.param(EXAMPLE + b" \n\t" * 1000, id="trailing whitespace"),
    pytest.param(envelope('{"a":1,"a":2}'), id="duplicate keys: the last wins"),
    pytest.param(envelope('{"s":"\\u00e9\\u2028\\n\\"\\\\\\/"}'), id="escapes"),
    pytest.param(envelope('{"s":"\\u0000"}'), id="escaped NUL"),
    pytest.param(
        envelope('{"s":"\\\\ud800 \\\\\\\\udc00"}'), id="text that looks like a surrogate"
    ),
    pytest.param(envelope('{"n":[0,-0,1.5,-2e-3,1E2,9223372036854775807]}'), id="numbers"),
    pytest.param(envelope('{"t":[true,false,null,{},[]]}'), id="literals and empties"),
    pytest.param(nested(MAX_DEPTH), id="as deep as allowed"),
    pytest.param(b"", id="empty body"),
    pytest.param(b"   ", id="only whitespace"),
    pytest.param(b"not json", id="not JSON"),
    pytest.param(b"[]", id="an array"),
    pytest.param(b'"text"', id="a string"),
    pytest.param(EXAMPLE + b" x", id="trailing garbage"),
    pytest.param(EXAMPLE + EXAMPLE, id="two documents"),
    pytest.param(EXAMPLE[:-10], id="cut short"),
    pytest.param(b"\xef\xbb\xbf" + EXAMPLE, id="byte order mark"),
    pytest.param(envelope('{"s":"\xff"}'), id="invalid UTF-8"),
    pytest.param(envelope('{"s":"a\x01b"}'), id="raw control character"),
    pytest.param(envelope('{"a":1,}'), id="trailing comma"),
    pytest.param(envelope("{'a':1}"), id="single quotes"),
    pytest.param(envelope('{"a":01}'), id="leading zero"),
    pytest.param(envelope('{"a":1 /* c */}'), id="comment"),
    pytest.param(nested(MAX_DEPTH + 1), id="one level too deep"),
    pytest.param(nested(100_000), id="far too deep"),
    pytest.param(envelope("[]"), id="object is an array"),
    pytest.param(
        b'{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{"uid":""}}',
        id="empty uid",
    ),
]


@pytest.mark.parametrize("piece", [1, 7, 16 * 1024], ids=["1 byte", "7 bytes", "16 KiB"])
@pytest.mark.parametrize("body", SAME)
def test_pieces_make_the_same_review_as_one_call(body: bytes, piece: int) -> None:
    assert outcome(lambda b: review_in_pieces(b, piece), body) == outcome(
        AdmissionReview.parse, body
    )


# Where the two parsers differ, in pieces the body is refused: kube-apiserver sends none of
# these (Go's encoder writes no NaN, characters beyond the BMP as UTF-8 rather than escaped
# pairs, and Kubernetes numbers are at most 64-bit).
DIFFERENT = [
    pytest.param(envelope('{"n":123456789012345678901234567890}'), id="128-bit int"),
    pytest.param(envelope('{"n":-9223372036854775808}'), id="-2**63"),
    pytest.param(envelope('{"n":NaN}'), id="NaN"),
    pytest.param(envelope('{"n":1e400}'), id="float overflow"),
    pytest.param(envelope('{"s":"\\ud800"}'), id="lone high surrogate"),
    pytest.param(envelope('{"s":"a\\udc00b"}'), id="lone low surrogate"),
    pytest.param(envelope('{"s":"\\ud800\\u0041"}'), id="high surrogate and a letter"),
    pytest.param(envelope('{"s":"\\ud83d\\ude00"}'), id="escaped pair"),
    pytest.param(envelope('{"s":"\\\\\\ud83d\\ude00"}'), id="pair after a backslash"),
]


@pytest.mark.parametrize("piece", [1, 2, 3, 5, 16 * 1024])
@pytest.mark.parametrize("body", DIFFERENT)
def test_where_the_parsers_differ_pieces_refuse(body: bytes, piece: int) -> None:
    with pytest.raises(ReviewError, match="not an AdmissionReview"):
        review_in_pieces(body, piece)


def test_the_error_is_one_line_without_the_document() -> None:
    with pytest.raises(JSONError) as caught:
        in_pieces(envelope('{"secret":"hunter2", "a":,}'), 4)
    assert "\n" not in str(caught.value)
    assert "hunter2" not in str(caught.value)


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63) + 1, 2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(alphabet=st.characters(exclude_categories=["Cs"])),
    lambda children: st.lists(children) | st.dictionaries(st.text(), children),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(value=json_values, cuts=st.lists(st.integers(1, 64), min_size=1, max_size=8))
def test_any_document_split_anywhere(value: Any, cuts: list[int]) -> None:
    body = json.dumps(value, ensure_ascii=False).encode()  # as Go writes it: UTF-8
    stream = JSONStream()
    start, i = 0, 0
    while start < len(body):
        stream.feed(body[start : start + cuts[i % len(cuts)]])
        start += cuts[i % len(cuts)]
        i += 1
    assert stream.close() == json.loads(body)
