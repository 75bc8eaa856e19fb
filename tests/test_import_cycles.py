"""No import cycle inside the package: modules form layers, each importing only those below.

The graph is built from the source (``ast``): an edge for every ``import`` at module level,
``if TYPE_CHECKING:`` blocks included (a cycle hidden there is a cycle of design all the same).
Imports inside functions are left out: they are how an optional dependency is loaded late.
"""

from __future__ import annotations

import ast
from pathlib import Path

import asyncgrpo

ROOT = Path(asyncgrpo.__file__).parent


def _module_name(path: Path) -> tuple[str, bool]:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    package = parts[-1] == "__init__"
    return ".".join(parts[:-1] if package else parts), package


def _imports(tree: ast.AST, name: str, package: bool) -> set[str]:
    """Modules imported at module level (not inside a function), as absolute names."""
    out: set[str] = set()
    todo = list(ast.iter_child_nodes(tree))
    while todo:
        node = todo.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = name.split(".") if package else name.split(".")[:-1]
                here = here[: len(here) - node.level + 1]
                base = ".".join([*here, base] if base else here)
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
        todo.extend(ast.iter_child_nodes(node))
    return out


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the package's modules it imports at module level."""
    modules = {_module_name(p): p for p in root.rglob("*.py")}
    names = {name for name, _ in modules}
    return {
        name: (_imports(ast.parse(path.read_text()), name, package) & names) - {name}
        for (name, package), path in modules.items()
    }


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = stack[stack.index(node) :]
                    del stack[stack.index(node) :]
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in stack:
                low[node] = min(low[node], index[child])
    return found


def test_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_in_the_package() -> None:
    graph = import_graph()
    assert graph.get("asyncgrpo.proxy.front")  # the graph sees the proxy's imports
    assert cycles(graph) == []
