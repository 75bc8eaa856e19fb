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

    ``replica`` names the replica that served the episode's model turns, as the proxy names it
    (``X-Asyncgrpo-Replica``; turns served by several are joined by ``+``; ``None`` without a
    proxy): the trainer's served-policy audit names the replica whose logprobs are wrong.

    ``sample_id`` is the episode's name from the rollout side (``<producer>-<prompt
    position>-<j>``, the producer a random name per rollout client), unique across every
    rollout process and restart of a run: the trainer records the ids it trains and drops
    (``samples.jsonl``), so "no sample trained twice, none lost" can be checked on the records.
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
    replica: str | None = None
    sample_id: str | None = None

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


@dataclass(frozen=True, slots=True)
class SampleBounds:
    """What one model can train on: a sample whose token id is at or past its vocabulary
    (an ``IndexError`` on CPU, a device-side assert on CUDA), whose prompt or completion is
    empty, that is longer than its context, or whose logprobs are not finite would stop the
    trainer (or poison its update) at every resume. Samples from another machine are checked
    against it before training (:class:`~asyncgrpo.store.channel.RolloutChannel`)."""

    vocab_size: int  #: token ids must be below this (the input embedding's rows)
    max_tokens: int | None = None  #: prompt + completion at most this (None: unbounded)

    def check(self, samples: Sequence[Sample]) -> None:
        """``ValueError`` naming the first sample out of bounds, and the bound."""
        for i, s in enumerate(samples):
            where = f"sample {i} (group {s.group_id[:40]!r})"
            if not s.prompt_ids or not s.completion_ids:
                what = "prompt" if not s.prompt_ids else "completion"
                raise ValueError(f"{where}: its {what} is empty")
            if self.max_tokens is not None and s.num_tokens > self.max_tokens:
                raise ValueError(
                    f"{where}: {s.num_tokens} tokens, more than the model's context of "
                    f"{self.max_tokens}"
                )
            low = min(min(s.prompt_ids), min(s.completion_ids))
            high = max(max(s.prompt_ids), max(s.completion_ids))
            if low < 0 or high >= self.vocab_size:
                bad = low if low < 0 else high
                raise ValueError(
                    f"{where}: token id {bad} is outside the model's vocabulary of "
                    f"{self.vocab_size}"
                )
            if not math.isfinite(sum(s.logprobs)):  # NaN and infinities carry through a sum
                raise ValueError(f"{where}: a logprob is not a finite number")


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


def centred_advantages(
    rewards: Sequence[float], advantages: Sequence[float], group_ids: Sequence[str]
) -> list[float]:
    """``r - mean(group)`` per sample, recovered from ``group_advantages``' output.

    The rollout client normalises each group by its ``std + eps`` before the trainer sees it;
    within a group every advantage is that same scale times ``r - mean``, so any two samples
    of different rewards give the scale back: ``(r_i - r_j) / (A_i - A_j)``. That holds for a
    group split over two optimizer steps too (only the samples present are needed). A group
    with all-zero advantages (equal rewards) stays 0, as does a NaN reward's sample and a lone
    sample whose siblings are in another step (its scale cannot be known; with
    ``samples_per_step`` a multiple of ``num_generations`` that does not happen).
    """
    if not len(rewards) == len(advantages) == len(group_ids):
        raise ValueError("rewards, advantages and group_ids must have one entry per sample")
    members: dict[str, list[int]] = {}
    for i, g in enumerate(group_ids):
        if not math.isnan(rewards[i]) and advantages[i] != 0.0:
            members.setdefault(g, []).append(i)
    out = [0.0] * len(rewards)
    for idx in members.values():
        hi = max(idx, key=lambda i: advantages[i])
        lo = min(idx, key=lambda i: advantages[i])
        if advantages[hi] == advantages[lo]:
            continue  # one sample (or one value) only: the scale is unknown
        scale = (rewards[hi] - rewards[lo]) / (advantages[hi] - advantages[lo])
        for i in idx:
            out[i] = advantages[i] * scale
    return out


def scale_advantages(
    rewards: Sequence[float],
    advantages: Sequence[float],
    group_ids: Sequence[str],
    scale: str,
    *,
    eps: float = 1e-4,
) -> list[float]:
    """The step's advantages under ``trainer.scale_rewards`` (TRL's ``scale_rewards``).

    ``advantages`` are the rollout's, ``(r - mean) / (std_group + eps)``. 'group' keeps them;
    'none' is ``r - mean`` (Dr. GRPO); 'batch' is ``(r - mean) / (std_batch + eps)`` with the
    sample std of all the step's valid rewards. A step whose rewards are all equal gives 0.
    """
    if scale == "group":
        return list(advantages)
    if scale not in ("batch", "none"):
        raise ValueError(f"unknown scale_rewards {scale!r}: use 'group', 'batch' or 'none'")
    centred = centred_advantages(rewards, advantages, group_ids)
    if scale == "none":
        return centred
    _, std = group_stats(rewards)
    if math.isnan(std) or std <= ZERO_STD_TOL:
        return [0.0] * len(rewards)
    return [a / (std + eps) for a in centred]
