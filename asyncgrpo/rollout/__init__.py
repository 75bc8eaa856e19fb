"""Rollout side: prompts in, scored and tagged ``Sample``s out into a bounded queue."""

from asyncgrpo.rollout.config import GenerationConfig, RolloutConfig

__all__ = ["GenerationConfig", "RolloutConfig"]
