"""Clipping the step's gradient before AdamW: to ``trainer.max_grad_norm`` and, with
``trainer.spike_clip_z``, to the level the run's recent gradient norms allow (the statistics are
:class:`~asyncgrpo.trainer.spike_clip.SpikeClip`'s, pure); the lower of the two wins."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from asyncgrpo.trainer.spike_clip import SpikeClip
from asyncgrpo.trainer.trust_region import global_norm

__all__ = ["GradientClip", "grad_norm"]


class GradientClip:
    """Clips a gradient in place to ``max_grad_norm`` and, with ``spike_clip_z``, to the level
    the run's recent norms allow (the ``trainer`` settings of those names; None: off).
    ``factor`` is the last step's spike-clip factor (1: none)."""

    def __init__(
        self,
        *,
        max_grad_norm: float | None = None,
        spike_clip_z: float | None = None,
        spike_clip_decay: float = 0.97,
        spike_clip_warmup: int = 5,
    ) -> None:
        self.max_norm = max_grad_norm
        self.spike: SpikeClip | None = None  #: the spike clip's statistics (None: off)
        if spike_clip_z is not None:
            self.spike = SpikeClip(spike_clip_z, decay=spike_clip_decay, warmup=spike_clip_warmup)
        self.factor = 1.0

    def __call__(self, params: Sequence[torch.Tensor]) -> float:
        """Clip the gradients of ``params``; returns their norm before clipping."""
        max_norm = self.max_norm
        norm: float | None = None
        if self.spike is not None:
            norm = grad_norm(params)
            self.factor = self.spike.factor(norm)
            if self.factor < 1.0:
                level = norm * self.factor
                max_norm = level if max_norm is None else min(max_norm, level)
        if max_norm is not None:
            return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        return grad_norm(params) if norm is None else norm


def grad_norm(params: Sequence[torch.Tensor]) -> float:
    """The L2 norm of the parameters' gradients taken together (0 for none)."""
    return global_norm([p.grad for p in params if p.grad is not None])
