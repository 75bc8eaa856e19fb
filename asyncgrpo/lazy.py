"""Lazy public names for a package, so importing it loads none of the modules behind them.

``import asyncgrpo`` must stay light (the proxy and the transports never load torch), and a
config must load without importing the launcher; each package lists its public names and the
module that defines each, and a name is imported on first access.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package`` that imports ``exports[name]`` on first use
    and keeps the value in the package, so later lookups are plain attribute reads."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
