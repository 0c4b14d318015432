"""The import graph of the daemon's packages: layers that only point down, and no circles.

The layers, lowest first: ``config`` < ``executor`` < ``health`` < ``supervisor``. A module
may import its own package and the ones below it, never one above (``TYPE_CHECKING`` imports
and imports inside functions count too: a circle hidden there is still one). Within a package
the modules' imports form no circle either.

``python -m tests.unit.test_layers`` prints the graph (each module and what it imports).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ("config", "executor", "health", "supervisor")


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the project modules it imports (``pkg.mod``; a package's ``__init__`` is ``pkg``)."""
    modules = {}
    for pkg in LAYERS:
        for path in (root / pkg).glob("*.py"):
            modules[pkg if path.stem == "__init__" else f"{pkg}.{path.stem}"] = path
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            graph[module].update(t for t in targets if t in modules and t != module)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def upward(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Imports from a lower layer into a higher one."""
    rank = {pkg: i for i, pkg in enumerate(LAYERS)}
    return sorted((a, b) for a, targets in graph.items() for b in targets
                  if rank[b.split(".")[0]] > rank[a.split(".")[0]])


def test_no_import_circles():
    assert circles(import_graph()) == []


def test_layers_only_point_down():
    assert upward(import_graph()) == []


def test_the_checks_can_fail():
    """A circle and an upward import are found (the checks above are not vacuous)."""
    graph = {"config.a": {"executor.b"}, "executor.b": {"config.a"}, "health.c": {"supervisor.d"}, "supervisor.d": set()}
    assert circles(graph) == [["config.a", "executor.b"]]
    assert upward(graph) == [("config.a", "executor.b"), ("health.c", "supervisor.d")]


if __name__ == "__main__":
    g = import_graph(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
    for module in sorted(g, key=lambda m: (LAYERS.index(m.split(".")[0]), m)):
        print(f"{module:32} -> {', '.join(sorted(t for t in g[module] if t not in LAYERS)) or '-'}")
    print("circles:", circles(g))
    print("upward imports:", upward(g))
