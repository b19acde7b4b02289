"""Size caps on the product's Python, checked by ``make lint``: a module, a class or a function
past its cap is a concept that wants splitting (docs/architecture.md, "Sizes").

Counted in source lines, docstrings and comments included: they are what a reader reads. Tests,
test doubles, benchmarks and generated code are not capped.

    python hack/sizes.py            # the product packages; exit 1 and a line per excess
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PRODUCT = ("core", "fracgpu", "webhook", "quota", "deviceplugin", "certs", "extender")
GENERATED = ("deviceplugin/_proto",)
CAPS = {"module": 500, "class": 300, "function": 80}


@dataclass(frozen=True, slots=True)
class Excess:
    path: Path
    line: int
    kind: str  # "module", "class" or "function"
    name: str
    lines: int

    def __str__(self) -> str:
        return (
            f"{self.path}:{self.line}: {self.kind} {self.name} has {self.lines} lines "
            f"(cap {CAPS[self.kind]}): split it by concept"
        )


def excesses(path: Path, source: str) -> Iterator[Excess]:
    """What in one module is over its cap."""
    lines = len(source.splitlines())
    if lines > CAPS["module"]:
        yield Excess(path, 1, "module", path.stem, lines)
    for node in ast.walk(ast.parse(source, str(path))):
        if isinstance(node, ast.ClassDef):
            kind = "class"
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            kind = "function"
        else:
            continue
        assert node.end_lineno is not None
        span = node.end_lineno - node.lineno + 1
        if span > CAPS[kind]:
            yield Excess(path, node.lineno, kind, node.name, span)


def product_modules(root: Path) -> Iterator[Path]:
    for package in PRODUCT:
        for path in sorted((root / package).rglob("*.py")):
            relative = path.relative_to(root)
            if not any(relative.is_relative_to(g) for g in GENERATED):
                yield relative


def main(root: Path) -> int:
    found = [e for path in product_modules(root) for e in excesses(path, (root / path).read_text())]
    for excess in found:
        print(excess, file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(Path(__file__).resolve().parent.parent))
