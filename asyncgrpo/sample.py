"""The unit of data between the rollout client and the trainer."""

from __future__ import annotations

import math
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
