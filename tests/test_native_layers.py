"""The hook's C units in layers, not a circle (native/src).

A unit is one source file with its header (``X.c`` and ``X.h``; ``X_internal.h`` is X's too; a
header with no source, like ``cuda_api.h``, is a unit of its own). Unit A depends on unit B when
a file of A includes a header of B, or when A's compiled object uses a symbol that B's object
defines (``nm``: undefined in A, defined in B). The graph of these dependencies must have no
cycle, so each unit can be read, built and tested with only those below it; and nothing may
depend on the top, ``interpose.c``, whose table names every family's entry points.

A weak definition that another unit's strong definition replaces at link time (the state's
do-nothing ``fg_upper_ops``, which the top overrides) is no edge: neither object uses the other's
symbol, which is the point of it.

The objects are built by ``make -C native objects`` into a temp dir: the release flags of the
library, one object per source.
"""

from __future__ import annotations

import itertools
import re
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from testkit.native_kit import NATIVE

SRC = NATIVE / "src"
TOP = "interpose"
# The entry-point families: each must reach neither the top nor what runs after fork (fork.c
# calls every family's reset, so a family that reached it would be a loop).
FAMILIES = (
    "memory",
    "memory_array",
    "memory_info",
    "memory_linear",
    "memory_pool",
    "memory_vmm",
    "graph",
    "throttle",
)
ABOVE_FAMILIES = frozenset({TOP, "fork", "memory_fork"})

INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)
# nm -P letters: uppercase is global; U undefined; w/v (lowercase) weak undefined; W/V weak defined.
UNDEFINED = frozenset("Uwv")
WEAK_DEFINED = frozenset("WV")

Graph = dict[str, set[str]]


@dataclass
class Symbols:
    """What one object defines (strongly or weakly) and what it uses from elsewhere."""

    strong: set[str] = field(default_factory=set)
    weak: set[str] = field(default_factory=set)
    undefined: set[str] = field(default_factory=set)


def parse_nm(text: str) -> Symbols:
    """Read ``nm -P`` output; local symbols (lowercase letters other than w/v) are nobody's."""
    syms = Symbols()
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 2:
            continue
        name, kind = parts[0], parts[1]
        if kind in UNDEFINED:
            syms.undefined.add(name)
        elif kind in WEAK_DEFINED:
            syms.weak.add(name)
        elif kind.isupper():
            syms.strong.add(name)
    return syms


def symbol_edges(objects: Mapping[str, Symbols]) -> dict[str, dict[str, set[str]]]:
    """unit -> unit it uses -> the symbols it uses there. A symbol goes to its strong definers,
    or to its weak ones when no unit defines it strongly; one no unit defines (libc's) is no
    edge."""
    strong: dict[str, set[str]] = {}
    weak: dict[str, set[str]] = {}
    for unit, syms in objects.items():
        for name in syms.strong:
            strong.setdefault(name, set()).add(unit)
        for name in syms.weak:
            weak.setdefault(name, set()).add(unit)
    edges: dict[str, dict[str, set[str]]] = {unit: {} for unit in objects}
    for unit, syms in objects.items():
        for name in syms.undefined:
            for definer in strong.get(name) or weak.get(name) or set():
                if definer != unit:
                    edges[unit].setdefault(definer, set()).add(name)
    return edges


def unit_of_header(header: str, sources: set[str]) -> str:
    stem = header.removesuffix(".h")
    if stem in sources:
        return stem
    base = stem.removesuffix("_internal")
    return base if base in sources else stem


def include_edges(src: Path) -> dict[str, dict[str, set[str]]]:
    """unit -> unit whose header it includes -> the headers. Only headers in src count (the
    generated contract header and the system's are nobody's unit)."""
    sources = {p.stem for p in src.glob("*.c")}
    local = {p.name for p in src.glob("*.h")}
    edges: dict[str, dict[str, set[str]]] = {}
    for path in sorted([*src.glob("*.c"), *src.glob("*.h")]):
        unit = path.stem if path.suffix == ".c" else unit_of_header(path.name, sources)
        mine = edges.setdefault(unit, {})
        for header in INCLUDE.findall(path.read_text()):
            if header not in local:
                continue
            target = unit_of_header(header, sources)
            if target != unit:
                mine.setdefault(target, set()).add(header)
    return edges


def merge(*layers: Mapping[str, Mapping[str, set[str]]]) -> dict[str, dict[str, set[str]]]:
    """One graph, each edge labelled with every include and symbol that makes it."""
    out: dict[str, dict[str, set[str]]] = {}
    for layer in layers:
        for unit, targets in layer.items():
            mine = out.setdefault(unit, {})
            for target, why in targets.items():
                mine.setdefault(target, set()).update(why)
                out.setdefault(target, {})
    return out


def plain(graph: Mapping[str, Mapping[str, set[str]]]) -> Graph:
    return {unit: set(targets) for unit, targets in graph.items()}


def find_cycle(graph: Mapping[str, set[str]]) -> list[str] | None:
    """A cycle as the units along it, first repeated at the end; None for a graph in layers.
    Depth first, in sorted order so the cycle reported is the same every run."""
    white, grey, black = 0, 1, 2
    colour = dict.fromkeys(graph, white)
    path: list[str] = []

    def visit(unit: str) -> list[str] | None:
        colour[unit] = grey
        path.append(unit)
        for nxt in sorted(graph.get(unit, ())):
            if colour.get(nxt, white) == grey:
                return [*path[path.index(nxt) :], nxt]
            if colour.get(nxt, white) == white:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        colour[unit] = black
        return None

    for unit in sorted(graph):
        if colour[unit] == white:
            found = visit(unit)
            if found:
                return found
    return None


def reach(graph: Mapping[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def describe(graph: Mapping[str, Mapping[str, set[str]]], cycle: list[str]) -> str:
    steps = [
        f"  {a} -> {b}: {', '.join(sorted(graph[a][b]))}" for a, b in itertools.pairwise(cycle)
    ]
    return "cycle " + " -> ".join(cycle) + "\n" + "\n".join(steps)


# ---- the checker itself, on graphs made up for it ---------------------------------------------


@pytest.mark.parametrize(
    ("graph", "cycle"),
    [
        pytest.param({}, None, id="no-units"),
        pytest.param({"a": set(), "b": set()}, None, id="no-edges"),
        pytest.param({"a": {"b"}, "b": {"c"}, "c": set()}, None, id="a-chain"),
        pytest.param({"a": {"b", "c"}, "b": {"d"}, "c": {"d"}, "d": set()}, None, id="a-diamond"),
        pytest.param({"a": {"b"}, "b": {"a"}}, ["a", "b", "a"], id="two-naming-each-other"),
        pytest.param(
            {"top": {"a"}, "a": {"b"}, "b": {"c"}, "c": {"a"}},
            ["a", "b", "c", "a"],
            id="a-loop-behind-a-chain",
        ),
        pytest.param({"a": {"a"}}, ["a", "a"], id="a-unit-naming-itself"),
    ],
)
def test_find_cycle(graph: Graph, cycle: list[str] | None) -> None:
    assert find_cycle(graph) == cycle


@pytest.mark.parametrize(
    ("line", "strong", "weak", "undefined"),
    [
        pytest.param(
            "fg_log T 0000000000000000 0000000000000062", {"fg_log"}, set(), set(), id="function"
        ),
        pytest.param("fg D 0000000000000000 0000000000000120", {"fg"}, set(), set(), id="data"),
        pytest.param(
            "fg_ready B 0000000000000000 0000000000000004", {"fg_ready"}, set(), set(), id="bss"
        ),
        pytest.param(
            "fg_real_table R 0000000000000000 00000000000009c0",
            {"fg_real_table"},
            set(),
            set(),
            id="rodata",
        ),
        pytest.param("fg_region_open U", set(), set(), {"fg_region_open"}, id="undefined"),
        pytest.param(
            "fg_upper_ops V 0000000000000000 0000000000000018",
            set(),
            {"fg_upper_ops"},
            set(),
            id="weak-object",
        ),
        pytest.param(
            "hook W 0000000000000000 0000000000000010", set(), {"hook"}, set(), id="weak-function"
        ),
        pytest.param("maybe w", set(), set(), {"maybe"}, id="weak-undefined"),
        pytest.param(
            "init_mu b 0000000000000000 0000000000000028", set(), set(), set(), id="local"
        ),
    ],
)
def test_parse_nm(line: str, strong: set[str], weak: set[str], undefined: set[str]) -> None:
    syms = parse_nm(line)
    assert (syms.strong, syms.weak, syms.undefined) == (strong, weak, undefined)


def test_a_weak_definition_replaced_by_a_strong_one_is_no_edge() -> None:
    objects = {
        "state": Symbols(weak={"ops"}, undefined={"log"}),
        "top": Symbols(strong={"ops"}, undefined={"init"}),
        "log": Symbols(strong={"log", "init"}),
    }
    assert plain(symbol_edges(objects)) == {"state": {"log"}, "top": {"log"}, "log": set()}


# ---- the hook ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def objects(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Symbols]:
    build = tmp_path_factory.mktemp("native-layers")
    made = subprocess.run(
        ["make", "-s", "-C", str(NATIVE), "objects", f"BUILD={build}", f"PYTHON={sys.executable}"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert made.returncode == 0, made.stdout + made.stderr
    out: dict[str, Symbols] = {}
    for obj in sorted((build / "obj").glob("*.o")):
        nm = subprocess.run(["nm", "-P", str(obj)], capture_output=True, text=True, check=True)
        out[obj.stem] = parse_nm(nm.stdout)
    return out


@pytest.fixture(scope="module")
def graph(objects: dict[str, Symbols]) -> dict[str, dict[str, set[str]]]:
    return merge(include_edges(SRC), symbol_edges(objects))


def test_every_source_is_compiled(objects: dict[str, Symbols]) -> None:
    assert set(objects) == {p.stem for p in SRC.glob("*.c")}


@pytest.mark.parametrize(
    ("unit", "below", "why"),
    [
        pytest.param("memory_linear", "state", "fg_init_slow", id="a-family-starts-the-hook"),
        pytest.param("memory_pool", "graph", "fg_graph_capturing", id="pools-ask-about-captures"),
        pytest.param("graph", "throttle", "fg_throttle_acquire", id="graph-launches-take-tokens"),
        pytest.param("state", "region", "fg_region_open", id="the-start-opens-the-region"),
        pytest.param("real", "dl", "fg_real_dlsym", id="resolving-uses-libc-dlsym"),
        pytest.param("fork", "throttle", "fg_throttle_after_fork", id="fork-resets-every-unit"),
        pytest.param(TOP, "memory_linear", "cuMemAlloc_v2", id="the-table-names-entry-points"),
        pytest.param("memory_internal", "state", "state.h", id="a-header-include"),
    ],
)
def test_the_graph_sees_known_edges(
    graph: dict[str, dict[str, set[str]]], unit: str, below: str, why: str
) -> None:
    """Not vacuous: includes and symbols both make edges (memory_internal.h is memory's)."""
    src_unit = "memory" if unit == "memory_internal" else unit
    assert why in graph[src_unit].get(below, set()), graph[src_unit]


def test_the_units_are_in_layers(graph: dict[str, dict[str, set[str]]]) -> None:
    cycle = find_cycle(plain(graph))
    if cycle is not None:
        pytest.fail(describe(graph, cycle))


def test_nothing_names_the_top(graph: dict[str, dict[str, set[str]]]) -> None:
    users = {unit: sorted(targets[TOP]) for unit, targets in graph.items() if TOP in targets}
    assert users == {}, f"{TOP} is named by {users}"


@pytest.mark.parametrize("family", FAMILIES)
def test_a_family_depends_only_downwards(
    graph: dict[str, dict[str, set[str]]], family: str
) -> None:
    above = reach(plain(graph), family) & ABOVE_FAMILIES
    assert not above, f"{family} reaches {sorted(above)}"
