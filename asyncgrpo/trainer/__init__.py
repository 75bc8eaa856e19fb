"""Trainer side: GRPO loss, packing, staleness, the LoRA policy and the loop.

Torch is imported by the submodules that need it, not here. Group advantages are computed on the
rollout side (:mod:`asyncgrpo.sample`). ``Trainer`` is re-exported lazily.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Trainer"]


def __getattr__(name: str) -> Any:
    if name == "Trainer":
        from asyncgrpo.trainer.loop import Trainer

        return Trainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
