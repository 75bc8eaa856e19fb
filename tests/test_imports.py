"""No import cycle among asyncgrpo's modules, counting imports inside functions too.

A cycle means two modules each need the other: a concept split in the wrong place. The graph is
read from the source (``ast``), so a deferred import inside a function cannot hide one.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import asyncgrpo

ROOT = Path(asyncgrpo.__file__).resolve().parent


def _modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the asyncgrpo modules it imports (a package's ``__init__`` is the package)."""
    modules = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets: set[str | None] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets |= {resolve(f"{node.module}.{a.name}") for a in node.names}
            elif isinstance(node, ast.Import):
                targets |= {resolve(a.name) for a in node.names}
        graph[name] = {t for t in targets if t and t != name and t.startswith("asyncgrpo")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                found.append(sorted([v, *component]))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle() -> None:
    graph = import_graph()
    assert graph["asyncgrpo.proxy.http.front"]  # the graph sees inside packages
    assert cycles(graph) == []


def test_a_cycle_is_found() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_proxy_loads_no_http_client() -> None:
    """The proxy speaks HTTP itself and reads vLLM through asyncgrpo.vllm.api: importing it (its
    server, its CLI) loads neither aiohttp nor httpx; only its admin client, for runs, does."""
    code = (
        "import sys, asyncgrpo.proxy, asyncgrpo.proxy.server, asyncgrpo.proxy.__main__,"
        " asyncgrpo.vllm.api;"
        "print(sorted(m for m in ('aiohttp', 'httpx') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
