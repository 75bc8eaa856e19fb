"""The optimizer step's trust region in policy space (``trainer.max_update_kl``).

AdamW sizes each coordinate's step by the learning rate, not by the gradient, and clipping the
gradient does not change that; how far a step of a given length moves the *policy* depends on
where the adapter is (near convergence, with peaked logits, the same length moves it much
further). With samples several versions stale the trainer sees the damage of an over-long step
only ``max_staleness`` steps later. So the step is measured where it matters: after the update,
the KL between the policy before and after it on the step's own tokens, and an update above
the bound is shrunk towards the old weights, TRPO's trust region applied after the fact instead
of by a constrained solve (and PPO's target_kl without stopping the step).

:class:`UpdateBound` applies it to a step just taken, after the bound on the step's RMS per
coordinate (``trainer.max_update_rms``); the functions below it are pure.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from asyncgrpo.trainer.batch import StepBatch, padding_row
from asyncgrpo.trainer.model import row_logprobs, row_vocab_logprobs
from asyncgrpo.trainer.packing import PackedRow

if TYPE_CHECKING:
    from asyncgrpo.trainer.distributed import DataParallel


class UpdateBound:
    """Shrinks an optimizer step of ``params`` (``model``'s adapter) just taken towards the
    weights before it: to ``max_update_rms`` learning rates per coordinate (RMS), then to
    ``max_update_kl`` nats of policy change, measured as ``update_kl`` says ('sampled' or
    'vocab') on the step's rows and on those of the last ``update_kl_history`` steps (the
    ``trainer`` settings of those names; None: that bound is off). ``dp``: every rank's tokens
    count."""

    def __init__(
        self,
        model: Any,
        params: Sequence[torch.Tensor],
        *,
        max_update_rms: float | None = None,
        max_update_kl: float | None = None,
        update_kl: str = "sampled",
        update_kl_history: int = 0,
        dp: DataParallel | None = None,
    ) -> None:
        self.model, self.params, self.dp = model, params, dp
        self.max_rms, self.max_kl = max_update_rms, max_update_kl
        self.vocab = update_kl == "vocab"
        #: the rows of the last ``update_kl_history`` steps: prompts the step did not train on
        self.history: deque[tuple[list[PackedRow], int]] = deque(maxlen=update_kl_history)

    def __call__(
        self, before: Sequence[torch.Tensor], batch: StepBatch, *, lr: float, stepped: bool
    ) -> dict[str, float]:
        """Bound the step that moved the parameters from ``before`` at learning rate ``lr``
        (``stepped``: the optimizer took it; a skipped step has no RMS to bound); returns the
        update's metrics: its norm, the adapter's, the factor it was shrunk by, its KL."""
        params = self.params
        kl, scale = math.nan, 1.0
        if self.max_rms is not None and stepped:
            delta = [p.detach() - b for p, b in zip(params, before, strict=True)]
            count = sum(d.numel() for d in delta)
            rms = global_norm(delta) / math.sqrt(count) / lr if count and lr > 0 else 0.0
            if rms > self.max_rms:
                scale = self.max_rms / rms
                shrink(params, before, scale)
        if self.max_kl is not None:
            kl = self._step_kl(before, batch)
            kl_factor = kl_scale(kl, self.max_kl)
            shrink(params, before, kl_factor)
            scale *= kl_factor
        return {
            "collapse/update_norm": global_norm(
                [p.detach() - b for p, b in zip(params, before, strict=True)]
            ),
            "collapse/adapter_norm": global_norm([p.detach() for p in params]),
            "collapse/update_scale": scale,
            "collapse/update_kl": kl,
        }

    @torch.no_grad()
    def _step_kl(self, before: Sequence[torch.Tensor], batch: StepBatch) -> float:
        """How far the step moved the policy: the KL on the step's own rows and on those of
        the steps before it (``history``), the largest of them."""
        kl = self._rows_kl(batch.rows, batch.micro_steps, batch.logps, before)
        for rows, micro_steps in self.history:
            kl = max(kl, self._rows_kl(rows, micro_steps, None, before))
        if self.history.maxlen:
            self.history.append((batch.rows, batch.micro_steps))
        return kl

    def _rows_kl(
        self,
        rows: Sequence[PackedRow],
        micro_steps: int,
        old_logps: Sequence[torch.Tensor] | None,
        before: Sequence[torch.Tensor],
    ) -> float:
        """KL(before || after) over ``rows``' tokens: per token the k3 of the sampled token,
        or the vocabulary KL(after || before) at its position, weighted by pi_before /
        pi_sampler of the sampled token with the weights normalised (self-normalised
        importance sampling: the tokens came from the sampler, and a token the policy had all
        but ruled out would otherwise dominate). ``old_logps``: pi_before of the sampled tokens
        when known (the step's own rows); otherwise a second forward at the old weights gives
        them. Every rank's tokens."""
        model, params, vocab = self.model, self.params, self.vocab
        num = den = 0.0
        for i in range(micro_steps):
            row = rows[i] if i < len(rows) else padding_row(rows)
            measure = row_vocab_logprobs if vocab else _token_logprobs
            new = measure(model, row)
            if vocab or old_logps is None:
                after = _swap(params, before)
                old_measure = measure(model, row)
                _swap(params, after)
            if i >= len(rows):
                continue
            if vocab:
                kl = vocab_kl(old_measure.double(), new.double())[1]
                targets = row.input_ids[row.completion_mask].to(new.device)
                old_tok = old_measure.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
            else:
                old_tok = old_measure if old_logps is None else old_logps[i]
                kl = token_kl(new.double(), old_tok.double())
            old_tok = old_logps[i] if old_logps is not None else old_tok
            behaviour = row.behaviour_logprobs[row.completion_mask].to(new.device).double()
            weight = torch.exp(old_tok.double() - behaviour)
            num += float((weight * kl).sum())
            den += float(weight.sum())
        if self.dp is not None:
            num, den = self.dp.sum([num, den])
        return num / den if den > 0 else 0.0


def _token_logprobs(model: torch.nn.Module, row: PackedRow) -> torch.Tensor:
    return row_logprobs(model, row, with_entropy=False)[0]


@torch.no_grad()
def _swap(params: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Copy ``values`` into ``params`` in place; returns what they held."""
    held = [p.detach().clone() for p in params]
    for p, v in zip(params, values, strict=True):
        p.copy_(v)
    return held


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
