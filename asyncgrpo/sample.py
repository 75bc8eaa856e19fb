"""The unit of data between the rollout client and the trainer, and its group advantages.

Advantages are computed by the rollout client while scoring, before the samples ever reach the
trainer, on machines without torch: so they live here, in pure Python, not on the trainer side.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(slots=True, kw_only=True)
class Sample:
    """One scored completion, tagged with the adapter version that generated it.

    ``logprobs`` are the behaviour policy's per-token logprobs as vLLM returned them with
    ``--logprobs-mode processed_logprobs``: after temperature, so the trainer must divide its
    logits by the same ``temperature`` before comparing.
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    reward: float
    advantage: float
    version: int
    group_id: str
    temperature: float = 1.0
    rewards: dict[str, float] = field(default_factory=dict)
    finish_reason: str | None = None

    def __post_init__(self) -> None:
        if len(self.logprobs) != len(self.completion_ids):
            raise ValueError(
                f"sample {self.group_id}: {len(self.logprobs)} logprobs for "
                f"{len(self.completion_ids)} completion tokens"
            )

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)

    @property
    def reward_ok(self) -> bool:
        return not math.isnan(self.reward)


#: Two rewards closer than this count as equal: a group whose rewards are all equal carries no
#: signal (every advantage would be 0 up to rounding), so its advantages are set to exactly 0.
ZERO_STD_TOL = 1e-8


def group_advantages(rewards: Sequence[float], *, eps: float = 1e-4) -> list[float]:
    """``(r - mean) / (std + eps)`` over one group of rewards.

    ``std`` is the sample standard deviation (Bessel-corrected, as ``torch.std`` and TRL).
    NaN rewards (a reward function that failed) get advantage 0 and are left out of the mean
    and std, so one failed score neither poisons nor shifts its siblings. With fewer than two
    valid rewards, or when the valid rewards are all equal, every advantage is exactly 0: such
    a group contributes nothing to the loss (its tokens still count in the normaliser).
    """
    valid = [r for r in rewards if not math.isnan(r)]
    if len(valid) < 2:
        return [0.0] * len(rewards)
    mean = sum(valid) / len(valid)
    std = math.sqrt(sum((r - mean) ** 2 for r in valid) / (len(valid) - 1))
    if std <= ZERO_STD_TOL:
        return [0.0] * len(rewards)
    return [0.0 if math.isnan(r) else (r - mean) / (std + eps) for r in rewards]


def group_stats(rewards: Sequence[float]) -> tuple[float, float]:
    """Mean and sample std of a group's valid rewards (NaN if fewer than 1 / 2 are valid)."""
    valid = [r for r in rewards if not math.isnan(r)]
    if not valid:
        return math.nan, math.nan
    mean = sum(valid) / len(valid)
    if len(valid) < 2:
        return mean, math.nan
    return mean, math.sqrt(sum((r - mean) ** 2 for r in valid) / (len(valid) - 1))
