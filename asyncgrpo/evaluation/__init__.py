"""Held-out evaluation of a run's adapter versions on the serving fleet.

The replicas already serve every recent version, so an evaluation is generation under a named
version plus the run's reward functions: it costs the trainer nothing but the fleet's time.
"""

from __future__ import annotations

from asyncgrpo.lazy import lazy_exports

_EXPORTS = {
    "EvalConfig": "asyncgrpo.config.evaluation",
    "EvalReport": "asyncgrpo.evaluation.runner",
    "evaluate": "asyncgrpo.evaluation.runner",
    "pass_at_k": "asyncgrpo.evaluation.scores",
    "summarize": "asyncgrpo.evaluation.scores",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
