"""An environment that fails one group (raises EpisodeError) costs that group only: the rollout
client counts it, logs it once with the environment's message, and the other groups train."""

from __future__ import annotations

import logging

import anyio
import pytest

from asyncgrpo.config.rollout import GenerationConfig, RolloutConfig
from asyncgrpo.errors import EpisodeError
from asyncgrpo.rollout.client import RolloutClient
from asyncgrpo.rollout.dataset import Prompt
from asyncgrpo.rollout.environment import Environment, Episode
from asyncgrpo.rollout.policy import PolicyClient


class FailsOddPrompts(Environment):
    """Odd prompts fail the way a broken environment does; even ones play without a model
    call (so no server is needed), with rewards that differ within the group."""

    provides_reward = True

    async def rollout(self, task: Prompt, policy: PolicyClient, index: int) -> Episode | None:
        if task.index % 2:
            raise EpisodeError(f"tool crashed on task {task.index}")
        return Episode(
            prompt_ids=[1, 2], completion_ids=[3], logprobs=[-0.1], version=0, reward=float(index)
        )


def test_a_failing_environment_costs_its_group_only(caplog: pytest.LogCaptureFixture) -> None:
    prompts = [Prompt(index=i, epoch=0, prompt="p", prompt_ids=[1, 2]) for i in range(6)]

    async def main() -> tuple[list, dict[str, float]]:
        client = RolloutClient(
            base_url="http://127.0.0.1:9",
            dataset=prompts,
            generation=GenerationConfig(num_generations=2, max_completion_length=4),
            rollout=RolloutConfig(max_inflight=4),
            policy=("m", 0),
            environment=FailsOddPrompts(
                tokenizer=None,
                generation=GenerationConfig(num_generations=2, max_completion_length=4),
            ),
        )
        async with client:
            samples = await client.get(6)
            tail = await client.get(1)
            return samples + tail, client.stats()

    with caplog.at_level(logging.WARNING, logger="asyncgrpo.rollout.client"):
        samples, stats = anyio.run(main)
    assert sorted({s.group_id for s in samples}) == ["0", "2", "4"]
    assert stats["rollout/env_failures_total"] == 3
    lines = [r.getMessage() for r in caplog.records if "environment failed" in r.getMessage()]
    assert len(lines) == 3 and all("tool crashed on task" in line for line in lines)
