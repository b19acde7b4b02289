"""Label and field selectors as kube-apiserver parses them (the subset the fake API server serves).

Label selectors: `k=v`, `k==v`, `k!=v`, `k in (a,b)`, `k notin (a,b)`, `k` (exists), `!k` (does not
exist), joined by commas. Field selectors: `f=v`, `f==v`, `f!=v`, joined by commas, over the field
labels each kind supports (anything else is rejected, as the real server does).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


class SelectorError(ValueError):
    """A selector the real server would reject with 400 BadRequest."""


_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_./]*[A-Za-z0-9])?"
_SET_RE = re.compile(rf"^\s*(?P<key>{_NAME})\s+(?P<op>in|notin)\s*\((?P<values>[^)]*)\)\s*$")
_CMP_RE = re.compile(rf"^\s*(?P<key>{_NAME})\s*(?P<op>==|=|!=)\s*(?P<value>[^=!]*?)\s*$")
_EXISTS_RE = re.compile(rf"^\s*(?P<neg>!?)\s*(?P<key>{_NAME})\s*$")


@dataclass(frozen=True)
class Requirement:
    key: str
    op: str  # "=", "!=", "in", "notin", "exists", "!exists"
    values: tuple[str, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        present = self.key in labels
        value = labels.get(self.key)
        if self.op == "exists":
            return present
        if self.op == "!exists":
            return not present
        if self.op in ("=", "in"):
            return present and value in self.values
        # "!=" and "notin" match objects that lack the key, as in Kubernetes.
        return value not in self.values


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside parentheses (`k in (a,b),x=y`)."""
    parts: list[str] = []
    depth = 0
    current: list[str] = []
    for char in text:
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    parts.append("".join(current))
    return parts


def parse_label_selector(text: str) -> list[Requirement]:
    if not text.strip():
        return []
    requirements: list[Requirement] = []
    for part in _split_top_level(text):
        if m := _SET_RE.match(part):
            values = tuple(v.strip() for v in m["values"].split(",") if v.strip())
            if not values:
                raise SelectorError(f"unable to parse requirement: {part!r}: empty value set")
            requirements.append(Requirement(m["key"], m["op"], values))
        elif m := _CMP_RE.match(part):
            op = "=" if m["op"] in ("=", "==") else "!="
            requirements.append(Requirement(m["key"], op, (m["value"],)))
        elif m := _EXISTS_RE.match(part):
            requirements.append(Requirement(m["key"], "!exists" if m["neg"] else "exists"))
        else:
            raise SelectorError(f"unable to parse requirement: {part!r}")
    return requirements


def parse_field_selector(text: str, supported: frozenset[str]) -> list[Requirement]:
    if not text.strip():
        return []
    requirements: list[Requirement] = []
    for part in text.split(","):
        m = _CMP_RE.match(part)
        if m is None:
            raise SelectorError(f"invalid field selector: {part!r} (only =, == and != are allowed)")
        if m["key"] not in supported:
            raise SelectorError(f"field label not supported: {m['key']}")
        op = "=" if m["op"] in ("=", "==") else "!="
        requirements.append(Requirement(m["key"], op, (m["value"],)))
    return requirements


def field_value(obj: Mapping[str, Any], path: str) -> str:
    """The string a field selector compares against; a missing field reads as ""."""
    node: Any = obj
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return ""
        node = node[part]
    if isinstance(node, bool):
        return "true" if node else "false"
    return "" if node is None else str(node)


Matcher = Callable[[Mapping[str, Any]], bool]


def compile_selectors(
    label_text: str, field_text: str, supported_fields: frozenset[str]
) -> Matcher:
    """One predicate over a stored object for both selectors; raises SelectorError when invalid."""
    labels = parse_label_selector(label_text)
    fields = parse_field_selector(field_text, supported_fields)

    def matches(obj: Mapping[str, Any]) -> bool:
        meta = obj.get("metadata") or {}
        obj_labels = meta.get("labels") or {}
        if not all(req.matches(obj_labels) for req in labels):
            return False
        for req in fields:
            value = field_value(obj, req.key)
            if (value == req.values[0]) != (req.op == "="):
                return False
        return True

    return matches
