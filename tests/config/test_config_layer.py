"""The configuration is the bottom layer: its modules raise, they never exit or print.

Read from the source (``ast``), deferred imports inside functions included, so no import can
hide: a module of ``asyncgrpo/config/`` (the loader and every component's section) imports only
the base modules below it and the configuration layer itself (``asyncgrpo.config.*``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import asyncgrpo

PACKAGE = Path(asyncgrpo.__file__).resolve().parent
#: What the configuration layer may import: the base modules that need nothing above them.
BASE = {"asyncgrpo.errors", "asyncgrpo.lazy"}
#: The components whose settings section is a module of ``asyncgrpo/config/``.
SECTIONS = ("rollout", "trainer", "proxy", "serve", "launch", "evaluation", "store", "tinker")


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return {name for name in found if name.split(".")[0] == "asyncgrpo"}


def _allowed(name: str) -> bool:
    return name in BASE or name.split(".")[:2] == ["asyncgrpo", "config"]


def test_the_config_package_imports_nothing_above_its_layer() -> None:
    modules = sorted((PACKAGE / "config").glob("*.py"))
    assert len(modules) >= 8  # the loader's modules are all seen, and every section:
    assert {f"{c}.py" for c in SECTIONS} <= {path.name for path in modules}
    wrong = {
        f"{path.name} imports {name}"
        for path in modules
        for name in _imports(path)
        if not _allowed(name)
    }
    assert not wrong, sorted(wrong)


def test_no_configuration_module_imports_the_console() -> None:
    """Deciding to print and exit is the command's: not the loader's, not a section's."""
    for path in sorted((PACKAGE / "config").glob("*.py")):
        assert "asyncgrpo.console" not in _imports(path), path
        assert "sys.exit" not in path.read_text(), path
