"""The run layer: joins the components into the processes a user starts.

The trainer process (:func:`run_training`), the split rollout process (:func:`run_rollouts`),
the launched trainer job, and what they share: the endpoint to the fleet, the adapter sync, the
sample sources, preflight checks and metrics.
"""

from __future__ import annotations

from asyncgrpo.lazy import lazy_exports

_EXPORTS = {
    "AdapterSync": "asyncgrpo.run.sync",
    "run_rollouts": "asyncgrpo.run.rollouts",
    "run_training": "asyncgrpo.run.training",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
