"""The layers of docs/architecture.md, checked on the source as it is.

import-linter (``make lint``) enforces the layer contract. These tests add what it does not
state: no two packages — top-level or a sub-package folder — import each other directly or
through others, counting imports inside functions and imports by string (``importlib``), and the
repository is self-contained (nothing points readers at documents it does not ship).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("core", "webhook", "quota", "certs", "deviceplugin", "extender", "fracgpu")
LAYER = {
    "core": 0,
    "webhook": 1,
    "quota": 1,
    "certs": 1,
    "deviceplugin": 1,
    "extender": 1,
    "fracgpu": 2,
}


def _package_of(module: str) -> str | None:
    """The package folder of a module: ``deviceplugin._proto.x`` → ``deviceplugin._proto``."""
    parts = module.split(".")
    if parts[0] not in PACKAGES:
        return None
    folder = ROOT.joinpath(*parts[:-1])
    while len(parts) > 1 and not (folder / parts[-1]).is_dir():
        parts = parts[:-1]
        folder = ROOT.joinpath(*parts[:-1])
    if (ROOT.joinpath(*parts)).is_dir():
        return ".".join(parts)
    return ".".join(parts[:-1]) or parts[0]


def _is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.is_dir() or path.with_suffix(".py").is_file()


def _imports(path: Path) -> set[str]:
    """Every module a file names: import statements anywhere, and importlib strings."""
    tree = ast.parse(path.read_text(), str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and re.fullmatch(r"[a-z_]+(\.[a-z_]+)+", node.value)
            and _is_module(node.value)
        ):
            found.add(node.value)
    return found


def _graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = defaultdict(set)
    for top in PACKAGES:
        for path in (ROOT / top).rglob("*.py"):
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            source = _package_of(module)
            assert source is not None
            for name in _imports(path):
                target = _package_of(name)
                if target and target != source:
                    edges[source].add(target)
    return edges


def _closure(edges: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    stack = list(edges.get(start, ()))
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(edges.get(node, ()))
    return seen


def _top(package: str) -> str:
    return package.split(".", maxsplit=1)[0]


def test_no_two_packages_import_each_other() -> None:
    edges = _graph()
    cycles = sorted(
        (a, b) for a in edges for b in _closure(edges, a) if a < b and a in _closure(edges, b)
    )
    assert cycles == []


def test_no_two_top_level_packages_import_each_other() -> None:
    edges: dict[str, set[str]] = defaultdict(set)
    for source, targets in _graph().items():
        edges[_top(source)].update(_top(t) for t in targets if _top(t) != _top(source))
    cycles = sorted(
        (a, b) for a in edges for b in _closure(edges, a) if a < b and a in _closure(edges, b)
    )
    assert cycles == []


@pytest.mark.parametrize("package", PACKAGES)
def test_a_package_imports_only_lower_layers(package: str) -> None:
    above = {
        _top(target)
        for source, targets in _graph().items()
        if _top(source) == package
        for target in targets
        if _top(target) != package and LAYER[_top(target)] >= LAYER[package]
    }
    assert above == set()


# What a reader who cloned the repository cannot follow: the design notes the project grew from.
_OUTSIDE = re.compile(r"DESIGN\s*§|reference(\.md)?\s*§|\.\./shared|shared/(DESIGN|reference)")


def test_nothing_points_at_documents_outside_the_repository() -> None:
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    pointers = [
        f"{name}:{number}"
        for name in tracked
        if name.endswith((".py", ".md", ".c", ".h", ".yaml", ".toml", "Makefile"))
        and name != "tests/test_architecture.py"
        for number, line in enumerate((ROOT / name).read_text().splitlines(), 1)
        if _OUTSIDE.search(line)
    ]
    assert pointers == []


def test_building_the_command_line_imports_no_heavy_dependency() -> None:
    """`fracgpu review` and `--help` must not pay for the Kubernetes client, gRPC or TLS."""
    probe = (
        "import sys, fracgpu.cli; fracgpu.cli.build_parser(); "
        "print(' '.join(sorted({m.split('.')[0] for m in sys.modules} & "
        "{'kubernetes_asyncio', 'cryptography', 'grpc', 'pynvml', 'aiohttp'})))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    assert loaded == []


@pytest.mark.parametrize(
    ("agent", "sibling"),
    [
        pytest.param("deviceplugin.dra.daemon", "deviceplugin.classic", id="dra-loads-no-classic"),
        pytest.param("deviceplugin.classic.daemon", "deviceplugin.dra", id="classic-loads-no-dra"),
    ],
)
def test_an_agent_loads_nothing_of_its_sibling(agent: str, sibling: str) -> None:
    """The import contract forbids the imports; this checks what a running agent pulls in,
    the other agent's wire definitions included (the v1beta1 device-plugin protos for DRA)."""
    foreign = {
        "deviceplugin.classic": (
            "deviceplugin.classic",
            "deviceplugin._proto.deviceplugin_v1beta1",
        ),
        "deviceplugin.dra": ("deviceplugin.dra", "deviceplugin._proto.dra_v1"),
    }[sibling]
    probe = (
        f"import sys, {agent}; "
        f"print(' '.join(sorted(m for m in sys.modules if m.startswith({foreign!r}))))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    assert loaded == []


def test_every_benchmark_runs_under_make_bench() -> None:
    """``make bench`` (``python -m bench``) calls each benchmark module's ``main([])``."""
    import importlib
    import pkgutil

    names = [
        m.name for m in pkgutil.iter_modules([str(ROOT / "bench")]) if not m.name.startswith("_")
    ]
    assert names
    for name in names:
        module = importlib.import_module(f"bench.{name}")
        assert callable(getattr(module, "main", None)), f"bench.{name} has no main(argv)"
