"""No import cycles among the product's Python modules.

import-linter (pyproject.toml) holds the packages to their layers; this holds each module to a
one-way dependency on the others, which the layers do not: two modules of one package may
still import each other. The graph is read from the source with ``ast``, not from an
interpreter, so every import counts: those under ``if TYPE_CHECKING:`` (a type named across
modules is a dependency even if it costs nothing at run time; the way out is to move the type
down, not to hide the import) and those inside functions (a lazy import defers a cycle, it does
not remove it).
"""

from __future__ import annotations

import ast
from collections import deque
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("core", "fracgpu", "webhook", "quota", "deviceplugin", "certs", "extender")

Graph = Mapping[str, Iterable[str]]

# Cycles the product has and the lead has chosen to keep for now, each as the set of its
# modules (a strongly connected component). An entry is a debt, not a permission: the test
# below fails when a listed cycle is gone, so that the list only shrinks.
ALLOWED_CYCLES: frozenset[frozenset[str]] = frozenset()


def modules(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """Dotted module name -> its file, for every module of ``packages`` under ``root``."""
    found: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _known(name: str, known: Mapping[str, Path]) -> str | None:
    """The longest prefix of ``name`` that is one of the modules (``a.b.C`` -> ``a.b``)."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def _targets(node: ast.AST, package: str, known: Mapping[str, Path]) -> list[str]:
    """The dotted names one import statement reaches (``from p import m`` reaches module
    ``p.m`` when there is one, else ``p``)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
        source = ".".join([*base, *([node.module] if node.module else [])])
    else:
        source = node.module or ""
    return [
        f"{source}.{alias.name}" if f"{source}.{alias.name}" in known else source
        for alias in node.names
    ]


def imports_of(name: str, path: Path, known: Mapping[str, Path]) -> set[str]:
    """The modules of ``known`` that module ``name`` imports, anywhere in its file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    reached: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        for target in _targets(node, package, known):
            module = _known(target, known)
            if module is not None and module != name:
                reached.add(module)
    return reached


def import_graph(root: Path, packages: Iterable[str]) -> dict[str, set[str]]:
    known = modules(root, packages)
    return {name: imports_of(name, path, known) for name, path in known.items()}


def components(graph: Graph) -> list[frozenset[str]]:
    """The strongly connected components of more than one module: each is one or more cycles."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            members = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                members.add(member)
                if member == node:
                    break
            if len(members) > 1:
                found.append(frozenset(members))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def one_cycle(graph: Graph, component: frozenset[str]) -> list[str]:
    """A shortest cycle through the component's first module, as a path that ends where it
    starts: what a reader follows to break it."""
    start = min(component)
    previous: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for succ in sorted(graph.get(node, ())):
            if succ not in component:
                continue
            if succ == start:
                path = [node]
                while path[-1] != start:
                    path.append(previous[path[-1]])
                return [*reversed(path), start]
            if succ not in previous:
                previous[succ] = node
                queue.append(succ)
    raise AssertionError(f"no cycle through {start} in {sorted(component)}")


# ---- the product -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def product() -> dict[str, set[str]]:
    return import_graph(ROOT, PACKAGES)


def test_no_import_cycles(product: dict[str, set[str]]) -> None:
    graph = product
    found = [c for c in components(graph) if c not in ALLOWED_CYCLES]
    described = [" -> ".join(one_cycle(graph, c)) for c in found]
    assert not described, "import cycles among product modules:\n" + "\n".join(described)


def test_allowed_cycles_still_exist(product: dict[str, set[str]]) -> None:
    """An allowed cycle that was broken leaves the list, so that it cannot come back unseen."""
    present = set(components(product))
    stale = [sorted(c) for c in ALLOWED_CYCLES if c not in present]
    assert not stale, f"no longer cycles; remove them from ALLOWED_CYCLES: {stale}"


def test_the_graph_covers_the_product(product: dict[str, set[str]]) -> None:
    """A sanity floor: the walk found the packages and an import known to exist."""
    assert {name.partition(".")[0] for name in product} == set(PACKAGES)
    assert "deviceplugin.shared.guardtypes" in product["deviceplugin.shared.sharing"]


# ---- the graph builder, on small trees ---------------------------------------------------


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        pytest.param(
            {"p/a.py": "import p.b\n", "p/b.py": ""},
            {"p.a": {"p.b"}, "p.b": set()},
            id="absolute-import",
        ),
        pytest.param(
            {"p/a.py": "from p.b import thing\n", "p/b.py": "thing = 1\n"},
            {"p.a": {"p.b"}, "p.b": set()},
            id="from-module-import-name",
        ),
        pytest.param(
            {"p/__init__.py": "", "p/a.py": "from p import b\n", "p/b.py": ""},
            {"p": set(), "p.a": {"p.b"}, "p.b": set()},
            id="from-package-import-module",
        ),
        pytest.param(
            {"p/__init__.py": "X = 1\n", "p/a.py": "from p import X\n"},
            {"p": set(), "p.a": {"p"}},
            id="from-package-import-name",
        ),
        pytest.param(
            {"p/q/a.py": "from . import b\nfrom .. import c\n", "p/q/b.py": "", "p/c.py": ""},
            {"p.q.a": {"p.q.b", "p.c"}, "p.q.b": set(), "p.c": set()},
            id="relative-imports",
        ),
        pytest.param(
            {"p/q/__init__.py": "from .b import X\n", "p/q/b.py": "X = 1\n"},
            {"p.q": {"p.q.b"}, "p.q.b": set()},
            id="relative-from-a-package-init",
        ),
        pytest.param(
            {
                "p/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                "    from p.b import T\n",
                "p/b.py": "T = int\n",
            },
            {"p.a": {"p.b"}, "p.b": set()},
            id="type-checking-counts",
        ),
        pytest.param(
            {"p/a.py": "def f():\n    import p.b\n", "p/b.py": ""},
            {"p.a": {"p.b"}, "p.b": set()},
            id="function-level-counts",
        ),
        pytest.param(
            {"p/a.py": "import os\nimport pydantic.fields\nfrom x.y import z\n"},
            {"p.a": set()},
            id="outside-the-packages-ignored",
        ),
        pytest.param({"p/a.py": "import p.a\n"}, {"p.a": set()}, id="itself-ignored"),
    ],
)
def test_import_graph(tmp_path: Path, files: dict[str, str], expected: dict[str, set[str]]) -> None:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert import_graph(tmp_path, ["p"]) == expected


@pytest.mark.parametrize(
    ("graph", "expected"),
    [
        pytest.param({"a": {"b"}, "b": {"c"}, "c": set()}, [], id="chain"),
        pytest.param({"a": {"b", "c"}, "b": {"d"}, "c": {"d"}, "d": set()}, [], id="diamond"),
        pytest.param({"a": {"b"}, "b": {"a"}}, [["a", "b", "a"]], id="two-modules"),
        pytest.param(
            {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}},
            [["a", "b", "c", "a"]],
            id="three-modules-and-an-outsider",
        ),
        pytest.param(
            {"a": {"b"}, "b": {"a"}, "x": {"y"}, "y": {"x"}},
            [["a", "b", "a"], ["x", "y", "x"]],
            id="two-separate-cycles",
        ),
        pytest.param(
            {"a": {"b", "c"}, "b": {"a"}, "c": {"a"}},
            [["a", "b", "a"]],
            id="two-cycles-one-component-shortest-shown",
        ),
    ],
)
def test_cycles(graph: dict[str, set[str]], expected: list[list[str]]) -> None:
    found = sorted(components(graph), key=min)
    assert [one_cycle(graph, c) for c in found] == expected
