"""``hack/sizes.py``, the size caps ``make lint`` enforces on the product's modules."""

from __future__ import annotations

from pathlib import Path

import pytest

from hack import sizes

ROOT = Path(__file__).resolve().parent.parent


def body(lines: int, indent: str = "    ") -> str:
    return "".join(f"{indent}x{i} = {i}\n" for i in range(lines))


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        pytest.param("def f():\n" + body(79), [], id="function-at-its-cap"),
        pytest.param("def f():\n" + body(80), [("function", "f", 81)], id="function-over"),
        pytest.param(
            "async def f():\n" + body(80), [("function", "f", 81)], id="async-function-over"
        ),
        pytest.param(
            "class C:\n    def m(self):\n" + body(80, " " * 8),
            [("function", "m", 81)],
            id="method-over",
        ),
        pytest.param(
            "class C:\n" + "".join(f"    def m{i}(self):\n        pass\n" for i in range(150)),
            [("class", "C", 301)],
            id="class-over",
        ),
        pytest.param(body(501, ""), [("module", "m", 501)], id="module-over"),
        pytest.param(body(500, ""), [], id="module-at-its-cap"),
    ],
)
def test_excesses(source: str, expected: list[tuple[str, str, int]]) -> None:
    found = [(e.kind, e.name, e.lines) for e in sizes.excesses(Path("m.py"), source)]
    assert found == expected


def test_an_excess_says_where_and_what_to_do() -> None:
    (excess,) = sizes.excesses(Path("pkg/m.py"), "def f():\n" + body(80))
    assert str(excess) == "pkg/m.py:1: function f has 81 lines (cap 80): split it by concept"


def test_generated_code_is_not_capped() -> None:
    assert not any(p.parts[:2] == ("deviceplugin", "_proto") for p in sizes.product_modules(ROOT))
    assert any(p.parts[0] == "webhook" for p in sizes.product_modules(ROOT))
