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
    """One scored episode, tagged with the adapter version(s) that generated it.

    ``completion_ids`` is everything after the prompt. In a single-turn episode every one of
    them is the policy's; in a multi-turn episode the environment's text (a tool result, a
    user's reply) sits between the model's turns: ``completion_mask[i]`` says whether token
    ``i`` is the policy's (only those carry loss) and ``versions[i]`` which adapter version
    produced it (a turn sent after a weight sync runs under the newer one). ``None`` means
    "all policy tokens" and "all at ``version``": the single-turn case costs nothing extra.
    ``version`` is the oldest version in the episode (its first model turn), so a staleness
    bound on ``version`` bounds every token.

    ``logprobs`` are the behaviour policy's per-token logprobs as vLLM returned them with
    ``--logprobs-mode processed_logprobs``: after temperature, so the trainer must divide its
    logits by the same ``temperature`` before comparing. Aligned with ``completion_ids``;
    environment tokens hold 0.0, which nothing reads.
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
    completion_mask: list[bool] | None = None
    versions: list[int] | None = None

    def __post_init__(self) -> None:
        n = len(self.completion_ids)
        for name in ("logprobs", "completion_mask", "versions"):
            values = getattr(self, name)
            if values is not None and len(values) != n:
                raise ValueError(
                    f"sample {self.group_id}: {len(values)} {name} for {n} completion tokens"
                )
        if self.versions is not None and self.versions and min(self.versions) != self.version:
            raise ValueError(
                f"sample {self.group_id}: version={self.version} but its oldest token is at "
                f"version {min(self.versions)}; version must be the episode's oldest"
            )

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)

    @property
    def num_policy_tokens(self) -> int:
        """Tokens the policy generated (the ones that carry loss)."""
        mask = self.completion_mask
        return len(self.completion_ids) if mask is None else sum(mask)

    def policy_mask(self) -> list[bool]:
        """``completion_mask``, spelled out when it is implicit (all policy tokens)."""
        mask = self.completion_mask
        return [True] * len(self.completion_ids) if mask is None else list(mask)

    def token_versions(self) -> list[int]:
        """The adapter version of each completion token, spelled out when implicit."""
        v = self.versions
        return [self.version] * len(self.completion_ids) if v is None else list(v)

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
