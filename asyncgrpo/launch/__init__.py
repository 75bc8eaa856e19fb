"""``asyncgrpo launch``: start a run's roles on separate machines, watch them, tear them down.

``await launch(cfg, backend="hf-jobs")`` (Hugging Face Jobs) or ``backend="local"`` (separate
process groups on this host) returns a :class:`~asyncgrpo.launch.launcher.LaunchHandle`. Names
are imported lazily: the ``launch`` config section is part of every config, and loading a
config must not import the launcher.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "JobSpec": "asyncgrpo.launch.plan",
    "LaunchConfig": "asyncgrpo.launch.config",
    "LaunchHandle": "asyncgrpo.launch.launcher",
    "launch": "asyncgrpo.launch.launcher",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
