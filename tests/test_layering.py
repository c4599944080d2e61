"""The packages' import graph stays layered: no import circle anywhere (imports inside functions and under
TYPE_CHECKING count too), nothing imports upward between packages (handlers -> snapshot -> runtime), and
inside runtime/ and handlers/ the folders keep their order (engine -> models -> layers -> quant, kernels beside layers;
cli -> server -> openai)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("runtime", "snapshot", "handlers")
INSTALLED = "warmstart"  # the folders install as warmstart.runtime, warmstart.snapshot, warmstart.handlers (setup.py)
# A package may import those after it, never those before it.
PACKAGE_ORDER = ("handlers", "snapshot", "runtime")
# The folders of runtime/ and handlers/ by height; a module may import its own folder and lower ones of its package.
HEIGHT = {
    "runtime.engine": 3, "runtime.models": 2, "runtime.layers": 1, "runtime.kernels": 1, "runtime.quant": 0,
    "handlers.cli": 2, "handlers.server": 1, "handlers.openai": 0,
}


def module_of(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(path: Path) -> list[str]:
    """The modules (and, for ``from m import n``, the would-be modules m.n) a file imports, anywhere in it."""
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return names


def import_graph() -> dict[str, set[str]]:
    """Each project module -> the project modules it imports, by folder (warmstart.runtime.x is runtime.x; a
    package's __init__ is not an edge: importing a name through it is how a subpackage is reached)."""
    files = {module_of(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        names = [n.removeprefix(f"{INSTALLED}.") for n in imported_names(path)]
        graph[mod].update(n for n in names if n in files and n != mod and files[n].name != "__init__.py")
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for mod, targets in graph.items():
        for target in targets:
            mine, theirs = mod.split(".")[0], target.split(".")[0]
            if PACKAGE_ORDER.index(theirs) < PACKAGE_ORDER.index(mine) or (
                mine == theirs and height(target) > height(mod) >= 0
            ):
                bad.append(f"{mod} -> {target}")
    return sorted(bad)


def height(module: str) -> int:
    """The module's folder's height, -1 outside those folders (no order is checked there)."""
    return HEIGHT.get(".".join(module.split(".")[:2]), -1)


def test_no_import_circles() -> None:
    assert circles(import_graph()) == []


def test_nothing_imports_upward() -> None:
    assert upward_imports(import_graph()) == []


@pytest.mark.parametrize(
    ("edges", "expected"),
    [({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]), ({"a": {"b"}, "b": set()}, [])],
)
def test_the_circle_search_finds_circles(edges: dict[str, set[str]], expected: list[list[str]]) -> None:
    assert circles(edges) == expected


def test_the_upward_check_finds_upward_imports() -> None:
    graph = {"runtime.engine.engine": {"snapshot.store", "runtime.models.model"}, "runtime.layers.ops":
             {"runtime.engine.sequence"}, "snapshot.store": set(), "runtime.models.model": set(),
             "runtime.engine.sequence": set(), "handlers.openai.requests": {"handlers.server.state"},
             "handlers.server.state": {"handlers.openai.requests", "runtime.engine.engine"}}  # fmt: skip
    assert upward_imports(graph) == [
        "handlers.openai.requests -> handlers.server.state", "runtime.engine.engine -> snapshot.store",
        "runtime.layers.ops -> runtime.engine.sequence",
    ]


def test_every_import_names_the_installed_packages() -> None:
    """``import runtime`` would find the folder only from the checkout's root, and there load a second copy of
    the package beside warmstart.runtime (two LLMEngine classes, two kernel registries)."""
    python = [p for folder in (*PACKAGES, "tests", "benchmarks") for p in (ROOT / folder).rglob("*.py")]
    found = [f"{path.relative_to(ROOT)} -> {name}" for path in python for name in imported_names(path)
             if name.split(".")[0] in PACKAGES]
    assert found == []


def test_test_modules_import_no_other_test_module() -> None:
    """Shared helpers live in tests/support/ and shared fixtures in a conftest.py: a test module imported by
    another would run its tests twice and tie the two files together."""
    found = []
    for path in (ROOT / "tests").rglob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            found += [f"{path.relative_to(ROOT)} -> {m}" for m in modules
                      if m.startswith("tests.") and m.rsplit(".", 1)[-1].startswith("test_")]
    assert found == []
