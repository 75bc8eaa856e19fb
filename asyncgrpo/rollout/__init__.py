"""Rollout side: prompts in, scored ``Sample``s out into a bounded queue.

Torch-free: the rollout client runs on a machine without the trainer's dependencies
(``transformers`` is imported only to load a tokenizer).
"""

from __future__ import annotations

from asyncgrpo.lazy import lazy_exports

_EXPORTS = {
    "DatasetConfig": "asyncgrpo.config.rollout",
    "Environment": "asyncgrpo.rollout.environment",
    "Episode": "asyncgrpo.rollout.environment",
    "GenerationConfig": "asyncgrpo.config.rollout",
    "GroupScores": "asyncgrpo.rollout.rewards",
    "MultiTurnEnv": "asyncgrpo.rollout.environment",
    "PolicyClient": "asyncgrpo.rollout.policy",
    "Prompt": "asyncgrpo.rollout.dataset",
    "PromptDataset": "asyncgrpo.rollout.dataset",
    "RewardScorer": "asyncgrpo.rollout.rewards",
    "RolloutClient": "asyncgrpo.rollout.client",
    "RolloutConfig": "asyncgrpo.config.rollout",
    "SingleTurnEnv": "asyncgrpo.rollout.environment",
    "Trajectory": "asyncgrpo.rollout.environment",
    "Turn": "asyncgrpo.rollout.policy",
    "encode_prompt": "asyncgrpo.rollout.dataset",
    "load_reward_func": "asyncgrpo.rollout.rewards",
    "load_tokenizer": "asyncgrpo.rollout.dataset",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
