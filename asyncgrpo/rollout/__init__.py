"""Rollout side: prompts in, scored and tagged ``Sample``s out into a bounded queue."""

from asyncgrpo.rollout.config import DatasetConfig, GenerationConfig, RolloutConfig

__all__ = ["DatasetConfig", "GenerationConfig", "RolloutConfig"]
