"""Trainer side: GRPO loss, group advantages, packing, staleness, the LoRA policy and the loop.

Torch is imported by the submodules that need it, not here: ``advantages`` and ``staleness``
are light enough for the rollout client, so ``from asyncgrpo.trainer.advantages import ...``
stays torch-free. ``Trainer`` is re-exported lazily.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Trainer"]


def __getattr__(name: str) -> Any:
    if name == "Trainer":
        from asyncgrpo.trainer.loop import Trainer

        return Trainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
