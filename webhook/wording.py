"""How admission's messages name a container and quote what it was given.

Every denial and warning names the container, the resource and the value as the user most
likely wrote it, so that the person reading ``kubectl apply``'s output can find and fix it.
"""

from __future__ import annotations

import json
from functools import lru_cache

from core.quantity import MAX_CHARS, QuantityError, format_decimal, parse_quantity


def container_ref(name: str) -> str:
    """How every message names a container: ``container "train"``, as kubectl users read it."""
    return f"container {json.dumps(name)}"


def quote(raw: object) -> str:
    """Any JSON value as a denial quotes it: as JSON, and short.

    A denial quotes what it refuses, not megabytes of it; and Python will not print an integer
    of more than 4,300 digits, which a hostile object can hold.
    """
    try:
        text = json.dumps(raw)
    except ValueError:
        return f"a number of {int.bit_length(raw)} bits" if isinstance(raw, int) else "a value"
    if len(text) > MAX_CHARS:
        return f"{text[:MAX_CHARS]}… ({len(text)} characters)"
    return text


def show(raw: object) -> str:
    """The value as the user most likely wrote it (``1500m`` reads back as ``1.5``)."""
    if isinstance(raw, str | int | float) and not isinstance(raw, bool):
        return _show_scalar(raw)
    return _show_any(raw)


# Admission shows the same few spellings over and over; Decimal formatting is not cheap.
@lru_cache(maxsize=4096, typed=True)
def _show_scalar(raw: str | int | float) -> str:
    return _show_any(raw)


def _show_any(raw: object) -> str:
    try:
        q = parse_quantity(raw)
    except QuantityError:
        return quote(raw)
    if q.format == "binary" or not isinstance(raw, str):
        return raw.strip() if isinstance(raw, str) else format_decimal(q.value)
    return format_decimal(q.value)
