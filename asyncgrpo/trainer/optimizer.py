"""AdamW over the adapter, its learning-rate schedule, and the step that skips a bad gradient."""

from __future__ import annotations

import logging
import math
import warnings
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from asyncgrpo.config.trainer import TrainerConfig

__all__ = ["lr_factor", "make_optimizer", "optimizer_step"]

logger = logging.getLogger(__name__)


def lr_factor(step: int, *, schedule: str, warmup_steps: int, max_steps: int) -> float:
    """Multiplier of the peak learning rate for optimizer step ``step`` (0-based).

    Warm-up ramps linearly to 1 over ``warmup_steps`` (step 0 already gets ``1/(warmup+1)``, so
    no step is wasted at lr 0); then ``constant`` stays at 1, ``linear`` and ``cosine`` decay
    towards 0 at ``max_steps``.
    """
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    if schedule == "linear":
        return 1.0 - progress
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown lr schedule {schedule!r}")


def make_optimizer(
    params: list[torch.nn.Parameter], trainer: TrainerConfig
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over the adapter and its learning-rate schedule, as ``trainer`` sets them."""
    optimizer = torch.optim.AdamW(
        params,
        lr=trainer.learning_rate,
        weight_decay=trainer.weight_decay,
        betas=(trainer.adam_beta1, trainer.adam_beta2),
        eps=trainer.adam_epsilon,
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: lr_factor(
            step,
            schedule=trainer.lr_schedule,
            warmup_steps=trainer.warmup_steps,
            max_steps=trainer.max_steps,
        ),
    )
    return optimizer, schedule


def optimizer_step(
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    grad_norm: float,
    step: int,
) -> None:
    """The optimizer's step and the schedule's, then the gradients cleared. A non-finite
    ``grad_norm`` skips the update (logged, naming optimizer step ``step``); the schedule
    still advances, with the step count."""
    if math.isfinite(grad_norm):
        optimizer.step()
        scheduler.step()
    else:
        logger.warning("step %d: gradient norm is %s; update skipped", step, grad_norm)
        with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()"
            warnings.simplefilter("ignore", UserWarning)
            scheduler.step()
    optimizer.zero_grad(set_to_none=True)
