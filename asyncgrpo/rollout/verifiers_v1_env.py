"""A verifiers 0.4 environment as an asyncgrpo :class:`~asyncgrpo.rollout.environment.Environment`.

``rollout.environment: {verifiers: NAME, args: {...}}`` with verifiers 0.4 installed: NAME is a
taskset id (an installed taskset module, dashes as underscores), ``args`` the rest of verifiers'
``[env]`` block (``agent: {harness: {id: null}, runtime: {type: subprocess}}``, taskset
options under ``taskset``). Each episode is ``Env.run_episode`` with a
:class:`~asyncgrpo.rollout.verifiers_v1.TurnClient` answering its model calls; the episode's
tokens are the client's record, its reward the trace's ``@vf.reward`` parts. A group whose
environment raised, timed out or returned a malformed episode raises
:class:`~asyncgrpo.errors.EpisodeError` (the rollout client drops that group).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import anyio
import verifiers.v1 as vf

from asyncgrpo.config.rollout import GenerationConfig
from asyncgrpo.errors import ConfigError
from asyncgrpo.rollout.chat_turns import ChatTurns, PlayedEnv, Seat, episode_of
from asyncgrpo.rollout.dataset import Prompt
from asyncgrpo.rollout.environment import Episode
from asyncgrpo.rollout.policy import PolicyClient
from asyncgrpo.rollout.verifiers_v1 import TurnClient, serving
from asyncgrpo.rollout.vf_worker import load, outcome, refusals, registered

__all__ = ["VerifiersV1Env"]


class VerifiersV1Env(PlayedEnv):
    """A verifiers 0.4 environment played token-exactly; see the module docstring.

    ``max_episode_tokens`` bounds each episode's sequence (keep it at most the replicas'
    ``--max-model-len``); ``episode_timeout_s`` bounds one episode (then its group is lost).
    The dataset rows come from the run's ``dataset`` section, validated as the taskset's
    ``TaskData`` (``prompt`` plus the fields its rewards read).
    """

    def __init__(
        self,
        *,
        tokenizer: Any,
        generation: GenerationConfig,
        name: str,
        args: Mapping[str, Any] | None = None,
        max_episode_tokens: int = 1024,
        episode_timeout_s: float = 120.0,
    ) -> None:
        super().__init__(tokenizer=tokenizer, generation=generation)
        if max_episode_tokens < 2 or episode_timeout_s <= 0:
            raise ConfigError(
                f"VerifiersV1Env: max_episode_tokens={max_episode_tokens} must be >= 2 and "
                f"episode_timeout_s={episode_timeout_s} > 0"
            )
        try:
            self.env = load(name, dict(args or {}))
        except Exception as exc:  # pydantic, import and plugin errors: the line names them
            first = str(exc).strip().splitlines()
            raise ConfigError(
                f"verifiers environment {name!r}: {type(exc).__name__}: {' '.join(first[:3])}"
            ) from exc
        problems = refusals(self.env)
        if problems:
            raise ConfigError(f"verifiers environment {name!r}: {problems[0]}")
        self.name, self.max_episode_tokens = name, max_episode_tokens
        self.episode_timeout_s = episode_timeout_s
        self._task_cls = type(self.env.taskset).task_type()
        turns = ChatTurns(
            tokenizer=tokenizer,
            max_tokens=generation.max_completion_length,
            max_episode_tokens=max_episode_tokens,
        )
        self.client = TurnClient(turns)
        self._config: Any = None

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        with registered(self.client) as self._config:
            async with serving(self.env):
                yield

    def task(self, task: Prompt) -> Any:
        """The run's dataset row as the taskset's task."""
        prompt = task.prompt if task.is_chat else [{"role": "user", "content": task.prompt}]
        data_cls = self._task_cls.data_type()
        fields = {k: v for k, v in task.extra.items() if k in data_cls.model_fields}
        try:
            data = data_cls.model_validate({**fields, "prompt": prompt, "idx": task.index})
        except Exception as exc:
            raise ConfigError(f"dataset row {task.index} is no {data_cls.__name__}: {exc}") from exc
        return self._task_cls(data, self.env.taskset.config.task)

    async def _play(self, task: Prompt, policy: PolicyClient, index: int) -> Episode | str:
        """The episode, or why it is unusable (the environment's own message)."""
        if self._config is None:
            raise RuntimeError("VerifiersV1Env plays episodes inside `async with env.running()`")
        minted: list[str] = []

        def take(trace: Any) -> None:  # verifiers mints each agent run's trace before it runs
            minted.append(trace.id)
            seed = lambda turn: self.seed(task, index, turn)  # noqa: E731
            self.client.seat(trace.id, Seat(policy, self.session(task), seed))

        ctx = vf.ModelContext(model=policy.model, client=self._config)
        try:
            with anyio.move_on_after(self.episode_timeout_s) as scope:
                played = await self.env.run_episode(self.task(task), ctx, on_trace=take)
        finally:
            seats = self.client.release(minted)
        for seat in seats.values():
            if seat.error is not None:
                raise seat.error  # the replicas', not the environment's: it stops the run
        if scope.cancelled_caught:
            return f"an episode ran past episode_timeout_s={self.episode_timeout_s:g}"
        return _episode(played, seats)


def _episode(played: Any, seats: dict[str, Seat]) -> Episode | str:
    """asyncgrpo's episode from verifiers' finished one and the seats' token records."""
    return episode_of(outcome(played), seats)
