"""The step's objective, one packed row at a time: the GRPO loss of
:mod:`asyncgrpo.trainer.loss` fed with what only the step knows.

The formulas are pure functions in ``loss.py``; this module hands them one row's completion
tokens with the step's counts (the normaliser of ``trainer.loss_type``), each token's staleness
from the trainer's policy clock, and, with ``trainer.beta``, the reference policy's logprobs (the
same forward with the adapter disabled). Metrics come back as sums that micro-steps and ranks
add up (:meth:`StepObjective.all_ranks`) before one division.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from asyncgrpo.trainer.loss import Objective, grpo_loss, stat_keys, token_normaliser
from asyncgrpo.trainer.model import row_logprobs

if TYPE_CHECKING:
    from asyncgrpo.trainer.batch import StepBatch
    from asyncgrpo.trainer.distributed import DataParallel
    from asyncgrpo.trainer.packing import PackedRow

__all__ = ["StepObjective"]


@dataclass
class StepObjective:
    """The per-token objective, the normalisation (``trainer.loss_type``), the completion-length
    bound of ``dr_grpo`` (None: each step's longest) and the staleness buckets of the metrics
    (``trainer.max_staleness + 1``)."""

    objective: Objective
    loss_type: str = "dapo"
    max_completion_length: int | None = None
    buckets: int = 1

    def row_loss(
        self,
        model: Any,
        row: PackedRow,
        logp: torch.Tensor,
        entropy: torch.Tensor | None,
        batch: StepBatch,
        clock: tuple[int, bool],
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """One row's share of the step's loss and its metric sums, from the policy's forward
        (``logp``, ``entropy`` of the row's completion tokens). ``clock``: the version
        staleness counts from, and whether the weights still equal it."""
        mask = row.completion_mask
        device = logp.device
        staleness = clock[0] - row.versions[mask]
        sequence_ids = row.sequence_ids[mask].to(device)
        normaliser = None
        if self.loss_type != "dapo":
            per_sequence = torch.bincount(sequence_ids, minlength=len(row.seq_lens))
            normaliser = token_normaliser(
                self.loss_type,
                per_sequence[sequence_ids],
                num_tokens=batch.num_tokens,
                num_sequences=batch.num_sequences,
                max_length=max(self.max_completion_length or 0, batch.longest),
            )
        reference = None
        if self.objective.beta > 0:  # the base model: the same forward, the adapter disabled
            with torch.no_grad(), model.disable_adapter():
                reference, _ = row_logprobs(model, row, with_entropy=False)
        return grpo_loss(
            logp,
            row.behaviour_logprobs[mask].to(device),
            row.advantages[mask].to(device),
            self.objective,
            num_tokens=batch.num_tokens,
            staleness=staleness,
            on_policy=(staleness == 0) & clock[1],
            buckets=self.buckets,
            sequence_ids=sequence_ids,
            entropy=entropy,
            reference_logp=reference,
            normaliser=normaliser,
        )

    def all_ranks(
        self, dp: DataParallel, loss: float, sums: dict[str, float]
    ) -> tuple[float, dict[str, float]]:
        """The step's loss and metric sums over every rank (maxima for ``*_max``)."""
        keys = stat_keys(self.buckets)
        summed = [k for k in keys if not k.endswith("_max")]
        maxed = [k for k in keys if k.endswith("_max")]
        loss, *values = dp.sum([loss, *(sums.get(k, 0.0) for k in summed)])
        highest = dp.max([sums.get(k, -math.inf) for k in maxed])
        return loss, dict(zip(summed + maxed, values + highest, strict=True))
