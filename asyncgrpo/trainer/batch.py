"""One optimizer step's packed rows and the counts its loss is normalised by.

The loss of a micro-step is divided by the whole step's completion tokens
(:mod:`asyncgrpo.trainer.loss`), so every count is known before the first micro-step: with
several ranks, all ranks' counts. FSDP also needs every rank to run the same number of forward
passes (each one gathers the sharded weights); a rank with fewer rows makes up the difference
with passes over :func:`padding_row`, whose loss is multiplied by 0.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from asyncgrpo.sample import Sample
from asyncgrpo.trainer.packing import PackedRow, build_row, pack_samples

if TYPE_CHECKING:
    from asyncgrpo.trainer.distributed import DataParallel

__all__ = ["StepBatch", "pack_step", "padding_row"]


@dataclasses.dataclass
class StepBatch:
    """One step's packed rows and counts (all ranks' counts when data-parallel)."""

    rows: list[PackedRow]
    num_tokens: int  #: completion tokens: the loss's normaliser
    total_tokens: int
    num_rows: int
    row_tokens_max: int
    num_sequences: int
    longest: int  #: the longest sample's policy tokens
    micro_steps: int  #: forward/backward passes (FSDP: equal on every rank)
    #: each micro-step's token logprobs before the update (detached): the KL trust region's base
    logps: list[torch.Tensor] = dataclasses.field(default_factory=list)

    def row(self, i: int) -> tuple[PackedRow, float]:
        """Micro-step ``i``'s row and the weight of its loss (0: a padding pass)."""
        if i < len(self.rows):
            return self.rows[i], 1.0
        return padding_row(self.rows), 0.0


def pack_step(
    samples: Sequence[Sample],
    *,
    token_budget: int | None,
    gradient_accumulation_steps: int,
    fsdp: bool = False,
    dp: DataParallel | None = None,
) -> StepBatch:
    """Token-budget rows (or ``gradient_accumulation_steps`` rows without a budget), with the
    step's counts: all ranks' counts when data-parallel."""
    rows = pack_samples(
        samples,
        token_budget=token_budget,
        num_rows=None if token_budget is not None else gradient_accumulation_steps,
    )
    batch = StepBatch(
        rows=rows,
        num_tokens=sum(row.num_completion_tokens for row in rows),
        total_tokens=sum(row.num_tokens for row in rows),
        num_rows=len(rows),
        row_tokens_max=max((row.num_tokens for row in rows), default=0),
        num_sequences=len(samples),
        longest=max((s.num_policy_tokens for s in samples), default=0),
        micro_steps=len(rows),
    )
    if dp is not None:  # the step's counts are all ranks' counts
        counts = dp.gather_counts(
            [
                batch.num_tokens,
                batch.total_tokens,
                batch.num_rows,
                batch.num_sequences,
                batch.row_tokens_max,
                batch.longest,
            ]
        )
        batch.num_tokens, batch.total_tokens, batch.num_rows, batch.num_sequences = (
            int(v) for v in counts[:, :4].sum(0)
        )
        batch.row_tokens_max, batch.longest = (int(v) for v in counts[:, 4:].max(0).values)
        if fsdp:  # FSDP gathers weights in every forward: equal pass counts everywhere
            batch.micro_steps = int(counts[:, 2].max())
    if batch.num_tokens == 0:
        raise ValueError("Trainer.step: the samples hold no completion tokens")
    return batch


def padding_row(rows: Sequence[PackedRow]) -> PackedRow:
    """A micro-batch that only keeps FSDP's collectives in step (its loss is multiplied by 0)."""
    if rows:
        return rows[-1]
    pad = Sample(
        prompt_ids=[0],
        completion_ids=[0],
        logprobs=[0.0],
        reward=0.0,
        advantage=0.0,
        version=0,
        group_id="padding",
    )
    return build_row([pad], [0])
