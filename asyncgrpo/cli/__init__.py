"""The ``asyncgrpo`` command line: ``main`` and its subcommands (train, rollout, launch, demo,
plot, check-serving).
"""

from __future__ import annotations

from asyncgrpo.lazy import lazy_exports

_EXPORTS = {
    "main": "asyncgrpo.cli.main",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
