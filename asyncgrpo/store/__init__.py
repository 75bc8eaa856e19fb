"""The documents a run keeps in its transport: adapter versions, checkpoints, the rollout channel,
the run's own records, and the verified bundles the first two are made of; and the format of the
metrics files a run directory keeps (:mod:`.metrics_file`).
"""

from __future__ import annotations

from asyncgrpo.lazy import lazy_exports

_EXPORTS = {
    "AdapterStore": "asyncgrpo.store.adapters",
    "AdapterVersion": "asyncgrpo.store.adapters",
    "CheckpointStore": "asyncgrpo.store.checkpoints",
    "RolloutChannel": "asyncgrpo.store.channel",
    "RunResult": "asyncgrpo.store.run_documents",
    "RunStore": "asyncgrpo.store.run_documents",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
