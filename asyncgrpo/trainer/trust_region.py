"""The optimizer step's trust region in policy space (``trainer.max_update_kl``).

AdamW sizes each coordinate's step by the learning rate, not by the gradient, and clipping the
gradient does not change that; how far a step of a given length moves the *policy* depends on
where the adapter is (near convergence, with peaked logits, the same length moves it much
further). With samples several versions stale the trainer sees the damage of an over-long step
only ``max_staleness`` steps later. So the step is measured where it matters: after the update,
the KL between the policy before and after it on the step's own tokens, and an update above
the bound is shrunk towards the old weights, TRPO's trust region applied after the fact instead
of by a constrained solve (and PPO's target_kl without stopping the step).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def global_norm(tensors: Sequence[torch.Tensor]) -> float:
    """The L2 norm of ``tensors`` taken together, as one vector (0 for none)."""
    if not tensors:
        return 0.0
    with torch.no_grad():
        norms = torch.stack([torch.linalg.vector_norm(t) for t in tensors])
        return float(torch.linalg.vector_norm(norms))


@torch.no_grad()
def shrink(params: Sequence[torch.Tensor], before: Sequence[torch.Tensor], scale: float) -> None:
    """Move ``params`` back towards ``before``, in place: ``before + scale * (params - before)``."""
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
    the change as quadratic in the step's length (KL's second-order term, the approximation
    TRPO's step size rests on; for a long step it is only that); 1 when within, off (None), or
    not finite."""
    if max_kl is None or not math.isfinite(kl) or kl <= max_kl:
        return 1.0
    return math.sqrt(max_kl / kl)


def vocab_kl(old: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position, exactly over the vocabulary, from log-distributions ``[positions, vocab]``:
    (KL(old || new), KL(new || old)). The second is the one a step that spreads a sure policy
    over tokens it had ruled out makes large (entropy rising: how a collapse starts), while
    the sampled tokens, which that policy gave probability ~1, barely register it."""
    p_old, p_new = old.exp(), new.exp()
    diff = old - new
    return (p_old * diff).sum(-1), (p_new * -diff).sum(-1)
