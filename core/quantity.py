"""Kubernetes resource quantities, parsed exactly.

The apiserver re-serialises every quantity before a webhook sees it (``0.3`` arrives as
``300m``, ``3000`` as ``3k``, ``1024Mi`` as ``1Gi``), while ``fracgpu review`` reads what the
user typed (YAML floats and ints included). Both must mean the same number, so parsing is done
once, here, with :class:`decimal.Decimal` and never with floats.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from functools import lru_cache
from typing import Literal

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "": Decimal(1),
    "k": Decimal("1e3"),
    "M": Decimal("1e6"),
    "G": Decimal("1e9"),
    "T": Decimal("1e12"),
    "P": Decimal("1e15"),
    "E": Decimal("1e18"),
}
# The grammar of k8s.io/apimachinery/pkg/api/resource: a signed decimal number, then a binary
# suffix, a decimal SI suffix, or a decimal exponent.
_QUANTITY = re.compile(
    r"^(?P<num>[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))"
    r"(?:(?P<bin>Ki|Mi|Gi|Ti|Pi|Ei)|(?P<exp>[eE][+-]?[0-9]+)|(?P<dec>[numkMGTPE]?))$"
)
# Quantities past these are certainly typos, and Decimal arithmetic on 1e999999 is slow. The
# length bound also keeps every parsed value printable: Python refuses to turn an integer of
# more than 4,300 digits into text, and a value is at most 64 digits scaled by 10^48 here.
_MAX_EXPONENT = 30
MAX_CHARS = 64
_MAX_INT = 10**MAX_CHARS

Format = Literal["binary", "decimal"]


class QuantityError(ValueError):
    """The text is not a Kubernetes quantity."""


@dataclass(frozen=True, slots=True)
class Quantity:
    """A parsed quantity: its exact value and whether a binary suffix (``Ki``…``Ei``) was used."""

    value: Decimal
    format: Format

    @property
    def is_integer(self) -> bool:
        return self.value == self.value.to_integral_value()


def parse_quantity(raw: object) -> Quantity:
    """Parse a quantity as the apiserver would, accepting the JSON/YAML scalars users write.

    YAML turns ``0.3`` into a float and ``3000`` into an int; both are converted through their
    shortest decimal text so that ``0.3`` is exactly 3/10. Booleans are not quantities.
    """
    if isinstance(raw, bool) or not isinstance(raw, str | int | float):
        raise QuantityError(f"{raw!r} is not a quantity")
    if isinstance(raw, int) and abs(raw) >= _MAX_INT:
        raise QuantityError(f"a quantity has at most {MAX_CHARS} digits")
    if isinstance(raw, str) and len(raw) > MAX_CHARS:
        # Checked before the cache, which would otherwise hold megabytes of hostile text.
        raise QuantityError(f"a quantity has at most {MAX_CHARS} characters; got {len(raw)}")
    return _parse(raw)


def quantity_int(raw: object) -> int | None:
    """A quantity's whole part, or None where ``raw`` is not a quantity: how the readers of
    objects the API server stored (claims, slices) take a capacity, which it has validated."""
    try:
        return int(parse_quantity(raw).value)
    except QuantityError:
        return None


# Admission parses the same few spellings ("300m", "8Gi") over and over; ``typed`` keeps
# 1 and 1.0 apart (their texts differ in what they may mean).
@lru_cache(maxsize=4096, typed=True)
def _parse(raw: str | int | float) -> Quantity:
    if isinstance(raw, int):
        return Quantity(Decimal(raw), "decimal")
    text = repr(raw) if isinstance(raw, float) else raw.strip()
    match = _QUANTITY.match(text)
    if match is None:
        raise QuantityError(f"{text!r} is not a quantity")
    try:
        number = Decimal(match["num"])
    except InvalidOperation as exc:  # pragma: no cover - the regex admits only valid numbers
        raise QuantityError(f"{text!r} is not a quantity") from exc
    if match["bin"]:
        return Quantity(number * _BINARY[match["bin"]], "binary")
    if match["exp"]:
        exponent = int(match["exp"][1:])
        if abs(exponent) > _MAX_EXPONENT:
            raise QuantityError(f"{text!r} is out of range")
        return Quantity(number.scaleb(exponent), "decimal")
    return Quantity(number * _DECIMAL[match["dec"] or ""], "decimal")


def format_decimal(value: Decimal) -> str:
    """Render an exact decimal without exponent or trailing zeros (``0.30`` → ``0.3``)."""
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")
