"""Trainer side: GRPO loss, packing, staleness, the LoRA policy and the loop.

Torch is imported by the submodules that need it, not here. Group advantages are computed on the
rollout side (:mod:`asyncgrpo.sample`). ``Trainer`` is re-exported lazily.
"""

from __future__ import annotations

from asyncgrpo.lazy import lazy_exports

_EXPORTS = {
    "Trainer": "asyncgrpo.trainer.loop",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
