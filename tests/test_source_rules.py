"""Rules the package's source keeps: short functions, and no benchmark figure in a docstring.

A function over 80 lines does several jobs; a measured figure in a docstring goes stale without
anyone noticing, so it belongs in ``docs/`` next to the command that measures it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import asyncgrpo

ROOT = Path(asyncgrpo.__file__).resolve().parent
MAX_FUNCTION_LINES = 80

#: A number with a unit of time, rate or ratio ...
_FIGURE = re.compile(
    r"\b\d[\d,.]*\s?(?:ms|µs|us|s|x|×|%|req/s|tokens?/s|tok/s|[KMG]i?B/s)(?![\w/])"
    r"|\b\d[\d,]* of \d[\d,]*\b"
)
#: ... in a paragraph that says it was measured.
_MEASURED = re.compile(r"measured|bench|faster|slower|took|on this machine|p50|p99", re.I)


def _functions(tree: ast.AST) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """``name (lines)`` of each function longer than ``limit`` lines, decorators excluded."""
    return [
        f"{f.name} ({f.end_lineno - f.lineno + 1})"
        for f in _functions(ast.parse(source))
        if f.end_lineno is not None and f.end_lineno - f.lineno + 1 > limit
    ]


def docstring_figures(source: str) -> list[str]:
    """Docstring paragraphs that hold a measured figure."""
    tree = ast.parse(source)
    nodes = [tree, *(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)), *_functions(tree)]
    found = []
    for node in nodes:
        doc = ast.get_docstring(node)  # type: ignore[arg-type]
        for paragraph in re.split(r"\n\s*\n", doc or ""):
            if _FIGURE.search(paragraph) and _MEASURED.search(paragraph):
                found.append(" ".join(paragraph.split())[:120])
    return found


def _sources() -> dict[str, str]:
    return {str(p.relative_to(ROOT.parent)): p.read_text() for p in sorted(ROOT.rglob("*.py"))}


def test_no_function_over_80_lines() -> None:
    found = {path: long for path, text in _sources().items() if (long := long_functions(text))}
    assert found == {}


def test_no_figure_in_a_docstring() -> None:
    found = {path: figs for path, text in _sources().items() if (figs := docstring_figures(text))}
    assert found == {}


def test_the_rules_see_what_they_forbid() -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(81))
    assert long_functions(f"def f():\n{body}\n") == ["f (82)"]
    assert long_functions("def g():\n    return 1\n") == []
    measured = '"""Fast.\n\nMeasured with bench/x.py: 3.2x faster, 12 ms p50."""\n'
    assert docstring_figures(measured) == ["Measured with bench/x.py: 3.2x faster, 12 ms p50."]
    dropped = 'def f():\n    """Measured: 864 of 1216 samples dropped."""\n'
    assert docstring_figures(dropped) == ["Measured: 864 of 1216 samples dropped."]
    assert docstring_figures('"""A timeout of 30 s, then a retry."""\n') == []


def test_test_modules_have_unique_basenames() -> None:
    """The test folders are no packages, so pytest imports each test module by its basename: a
    second ``test_cli.py`` elsewhere stops the whole collection ("import file mismatch")."""
    tests = Path(__file__).resolve().parent
    seen: dict[str, list[str]] = {}
    for path in tests.rglob("*.py"):
        if path.name not in ("conftest.py", "__init__.py"):
            seen.setdefault(path.name, []).append(str(path.relative_to(tests)))
    assert not {name: where for name, where in seen.items() if len(where) > 1}
