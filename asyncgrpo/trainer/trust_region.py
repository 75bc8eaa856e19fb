"""The optimizer step's trust region: a cap on how far one update may move the adapter.

AdamW divides each coordinate's gradient by the root of its own running mean square, so the
size of an update follows the learning rate, not the gradient: a gradient spike in a direction
with little history, or a take-off where every coordinate moves at once, moves the adapter as
far as a step of real signal. With samples several versions stale the trainer sees the damage
of such a step only ``max_staleness`` steps later. ``trainer.max_update_ratio`` bounds the step
instead: ``||delta|| <= ratio * ||adapter||`` (the idea of LAMB's trust ratio and of the update
clipping of Adafactor and StableAdamW, applied to the whole adapter), so one step can change
the policy by a bounded share of what the adapter has learned, whatever the gradient did.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def update_scale(update_norm: float, param_norm: float, max_ratio: float | None) -> float:
    """The factor in (0, 1] that brings an update of ``update_norm`` within ``max_ratio`` of
    the adapter's norm before it, ``param_norm``; 1 when it is within already, when the cap is
    off (None), or when the adapter has no norm to measure against (all zeros)."""
    if max_ratio is None or param_norm <= 0 or not math.isfinite(update_norm):
        return 1.0
    limit = max_ratio * param_norm
    return 1.0 if update_norm <= limit else limit / update_norm


def global_norm(tensors: Sequence[torch.Tensor]) -> float:
    """The L2 norm of ``tensors`` taken together, as one vector (0 for none)."""
    if not tensors:
        return 0.0
    with torch.no_grad():
        norms = torch.stack([torch.linalg.vector_norm(t) for t in tensors])
        return float(torch.linalg.vector_norm(norms))


@torch.no_grad()
def cap_update(
    params: Sequence[torch.Tensor], before: Sequence[torch.Tensor], max_ratio: float | None
) -> tuple[float, float, float]:
    """Shrink the step just taken from ``before`` to ``params`` (in place) into the trust
    region: (the update's norm after the cap, the adapter's norm after it, the scale applied)."""
    norm = global_norm([p.detach() - b for p, b in zip(params, before, strict=True)])
    scale = update_scale(norm, global_norm(before), max_ratio)
    shrink(params, before, scale)
    return norm * scale, global_norm(params), scale


@torch.no_grad()
def shrink(params: Sequence[torch.Tensor], before: Sequence[torch.Tensor], scale: float) -> None:
    """Move ``params`` back towards ``before``: ``before + scale * (params - before)``."""
    if scale < 1.0:
        for p, b in zip(params, before, strict=True):
            p.copy_(b + (p.detach() - b) * scale)


def token_kl(new_logp: torch.Tensor, old_logp: torch.Tensor) -> torch.Tensor:
    """Per token, k3 = r - 1 - log r with r = pi_new / pi_old (>= 0): on tokens drawn from
    pi_old its mean estimates KL(pi_old || pi_new), as PPO's approx_kl."""
    log_r = new_logp - old_logp
    return torch.expm1(log_r) - log_r


def kl_scale(kl: float, max_kl: float | None) -> float:
    """The factor that brings a step whose policy change is ``kl`` within ``max_kl``, taking
    the change as quadratic in the step's length near the start (KL's second-order term, the
    approximation TRPO's step size rests on); 1 when within, off, or not finite."""
    if max_kl is None or not math.isfinite(kl) or kl <= max_kl:
        return 1.0
    return math.sqrt(max_kl / kl)
