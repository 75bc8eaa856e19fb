"""Rollout side: prompts in, scored ``Sample``s out into a bounded queue.

Torch-free: the rollout client runs on a machine without the trainer's dependencies
(``transformers`` is imported only to load a tokenizer).
"""

from asyncgrpo.rollout.client import RolloutClient
from asyncgrpo.rollout.config import DatasetConfig, GenerationConfig, RolloutConfig
from asyncgrpo.rollout.dataset import Prompt, PromptDataset, encode_prompt, load_tokenizer
from asyncgrpo.rollout.environment import (
    Environment,
    Episode,
    MultiTurnEnv,
    SingleTurnEnv,
    Trajectory,
)
from asyncgrpo.rollout.policy import PolicyClient, Turn
from asyncgrpo.rollout.rewards import GroupScores, RewardScorer, load_reward_func

__all__ = [
    "DatasetConfig",
    "Environment",
    "Episode",
    "GenerationConfig",
    "GroupScores",
    "MultiTurnEnv",
    "PolicyClient",
    "Prompt",
    "PromptDataset",
    "RewardScorer",
    "RolloutClient",
    "RolloutConfig",
    "SingleTurnEnv",
    "Trajectory",
    "Turn",
    "encode_prompt",
    "load_reward_func",
    "load_tokenizer",
]
