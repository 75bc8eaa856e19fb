"""What the trainer does on a collapse alarm (``trainer.collapse_action``): warn, stop, roll back.

Rank 0 feeds each step's mean reward to the alarm (:class:`~asyncgrpo.trainer.collapse.
CollapseDetector`, pure); on a collapse it logs one line and, as configured, asks the caller to
stop (``stop_requested``) or restores the adapter and optimizer state of the best step from
memory, at a lower learning rate.

The best step is judged by the policy that earned the reward: the oldest version among the
step's samples, as it was published (:meth:`CollapseGuard.published` keeps the state of the
last ``max_staleness + 1`` versions). With stale samples a high reward is the old policy's: the
current one may already be breaking while they still score well.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Sequence
from typing import Any

import torch

from asyncgrpo.sample import Sample
from asyncgrpo.trainer.collapse import CollapseDetector

__all__ = ["CollapseGuard"]

logger = logging.getLogger(__name__)

#: The log line's words for each action.
_WHAT = {
    "warn": "no action (trainer.collapse_action=warn)",
    "stop": "stopping the run (trainer.collapse_action=stop)",
    "rollback": "rolling back",
}


class CollapseGuard:
    """The alarm over the rewards of ``model``'s steps and its action, as the ``trainer``
    settings of the same names say; a rollback restores the adapter and ``optimizer`` and
    multiplies the learning rate of ``scheduler`` by ``collapse_lr_factor`` (once more at each
    rollback). ``max_staleness + 1`` published versions are kept for it."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LambdaLR,
        *,
        collapse_action: str,
        collapse_window: int,
        collapse_drop: float,
        collapse_min_gain: float,
        collapse_lr_factor: float,
        max_staleness: int,
    ) -> None:
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.action = collapse_action
        self.window = collapse_window
        self.detector = CollapseDetector(
            window=collapse_window, drop=collapse_drop, min_gain=collapse_min_gain
        )
        self.lr_factor = collapse_lr_factor
        self.keep_versions = max_staleness + 1
        self._base_lrs = list(scheduler.base_lrs)
        #: set when collapse_action=stop fired: the caller ends the run after this step
        self.stop_requested = False
        self.rollbacks = 0
        self._best: tuple[int, dict[str, Any]] | None = None  # the rollback's (step, state)
        #: collapse_action=rollback: the (step, state) each recent published version had
        self.snapshots: dict[int, tuple[int, dict[str, Any]]] = {}

    def published(self, version: int, step: int) -> None:
        """The current weights are published as ``version`` at optimizer step ``step``: with
        action=rollback, keep their state (samples of this version may earn the best reward)."""
        if self.action == "rollback":
            self.snapshots[version] = (step, self._state())
            for old in sorted(self.snapshots)[: -self.keep_versions]:
                del self.snapshots[old]

    def __call__(
        self, metrics: dict[str, float], samples: Sequence[Sample], step: int
    ) -> dict[str, float]:
        """The alarm on the reward of a step's ``metrics`` (``step`` steps taken so far), and
        its action; returns the collapse metrics."""
        out = {
            "collapse/entropy": metrics.get("entropy", math.nan),
            "collapse/kl_sampler": metrics.get("kl", math.nan),
            "collapse/weight_max": metrics.get("off_policy/weight_max", math.nan),
        }
        if self.action == "off" or "reward" not in metrics:
            return out
        verdict = self.detector.update(metrics["reward"])
        out["collapse/reward_mean"] = verdict.mean
        out["collapse/reward_best"] = verdict.best
        out["collapse/alarm"] = float(verdict.alarm)
        if self.action == "rollback":
            if verdict.new_best:
                self._best = self._scoring_state(samples, step)
            out["collapse/rollbacks"] = float(self.rollbacks + verdict.alarm)
        if not verdict.alarm:
            return out
        what = _WHAT[self.action]
        if self.action == "rollback" and self._best is not None:
            what = self._rollback(step)
        elif self.action == "stop":
            self.stop_requested = True
        logger.warning(
            "collapse alarm at step %d: reward mean %.3g over %d steps, best %.3g, start %.3g; "
            "entropy %.3g, kl to sampler %.3g, max importance weight %.3g, update norm %.3g; %s",
            step,
            verdict.mean,
            self.window,
            verdict.best,
            verdict.start,
            out["collapse/entropy"],
            out["collapse/kl_sampler"],
            out["collapse/weight_max"],
            metrics.get("collapse/update_norm", math.nan),
            what,
        )
        return out

    def _state(self) -> dict[str, Any]:
        """A copy of what a rollback restores: the adapter and the optimizer's state."""
        adapter = {
            n: p.detach().cpu().clone() for n, p in self.model.named_parameters() if p.requires_grad
        }
        return {"adapter": adapter, "optimizer": copy.deepcopy(self.optimizer.state_dict())}

    def _scoring_state(self, samples: Sequence[Sample], step: int) -> tuple[int, dict[str, Any]]:
        """The step and state of the policy that earned these samples' rewards: the oldest
        version among them, as it was published. Unknown versions (never published here):
        the current weights."""
        oldest = min(s.version for s in samples)
        if oldest in self.snapshots:
            at, state = self.snapshots[oldest]
            return at, copy.deepcopy(state)
        return step, self._state()

    def _rollback(self, step: int) -> str:
        """Restore the best step's adapter and optimizer, keep the step count, lower the lr."""
        assert self._best is not None
        best_step, best = self._best
        state = copy.deepcopy(best)
        factor = self.lr_factor ** (self.rollbacks + 1)
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if p.requires_grad:
                    p.copy_(state["adapter"][name].to(p.device, p.dtype))
        self.optimizer.load_state_dict(state["optimizer"])
        scheduler = self.scheduler
        scheduler.base_lrs = [lr * factor for lr in self._base_lrs]
        for group, lr in zip(self.optimizer.param_groups, scheduler.base_lrs, strict=True):
            group["lr"] = lr * scheduler.lr_lambdas[0](step)
        self.rollbacks += 1
        self.detector.forget_recent()
        return (
            f"rolled back to the adapter of step {best_step}, learning rate x{factor:g} "
            "(trainer.collapse_action=rollback)"
        )
