"""``verifiers`` environments played token-exactly through asyncgrpo's policy client.

A verifiers environment (``SingleTurnEnv``, ``MultiTurnEnv``, ``ToolEnv``, ...) drives an
OpenAI-compatible client: ``rollout(input, client, model, sampling_args)`` calls
``client.chat.completions.create(messages=..., tools=...)`` once per model turn, with the whole
conversation so far. Sent to vLLM as messages, each turn would re-render and re-tokenise the
conversation, so the ids the trainer sees would not be those the policy sampled. Here the client
is asyncgrpo's: the first turn is the prompt through the chat template (with the environment's
tools); every later turn is the previous turn's exact ids, the model's sampled ids, and only the
environment's new messages rendered once (:class:`~asyncgrpo.rollout.environment.ChatContinuation`),
sent to ``/v1/completions`` as token ids. The environment's rubric scores each group.

Configured as ``rollout.environment: {verifiers: NAME, args: {...}}``: ``verifiers.load_environment
(NAME, **args)`` imports the installed module NAME (dashes as underscores) and calls its
``load_environment``. Needs the ``asyncgrpo[envs]`` extra.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import re
from collections.abc import Mapping
from typing import Any

import anyio

from asyncgrpo.config.rollout import GenerationConfig
from asyncgrpo.errors import AsyncGRPOError, ConfigError
from asyncgrpo.rollout.dataset import Prompt, encode_prompt
from asyncgrpo.rollout.environment import (
    ChatContinuation,
    Environment,
    Episode,
    Message,
    Trajectory,
)
from asyncgrpo.rollout.policy import PolicyClient, Turn

__all__ = ["VerifiersEnv", "parse_tool_calls"]

logger = logging.getLogger(__name__)


_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_tool_calls(text: str) -> list[dict[str, Any]]:
    """The tool calls in a model turn written as Hermes/Qwen chat templates ask for
    (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``), in OpenAI's form; blocks
    that are not such JSON are left as text (the environment then sees no call)."""
    calls = []
    for i, body in enumerate(_TOOL_CALL.findall(text)):
        try:
            call = json.loads(body)
        except ValueError:
            continue
        if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
            continue
        args = call.get("arguments", {})
        calls.append(
            {
                "id": f"call_{i}",
                "type": "function",
                "function": {
                    "name": call["name"],
                    "arguments": args if isinstance(args, str) else json.dumps(args),
                },
            }
        )
    return calls


class _Play:
    """One episode: answers the environment's chat-completion calls token-exactly."""

    def __init__(self, env: VerifiersEnv, task: Prompt, policy: PolicyClient, index: int) -> None:
        self.env, self.task, self.policy, self.index = env, task, policy, index
        self.traj: Trajectory | None = None
        self.sent: list[Message] = []  # the conversation of the last turn, with its answer
        self.last: Turn | None = None
        self.error: AsyncGRPOError | None = None  # ours, which verifiers would swallow

    async def create(
        self, *, model: str, messages: list[Message], tools: Any = None, **_: Any
    ) -> Any:
        """Stands in for ``AsyncOpenAI.chat.completions.create``; sampling settings come from
        the run's ``generation`` section, not from the environment."""
        try:
            return await self._turn(list(messages), tools)
        except AsyncGRPOError as exc:
            self.error = exc
            raise

    async def _turn(self, messages: list[Message], tools: Any) -> Any:
        from openai.types.chat import ChatCompletion
        from verifiers import OverlongPromptError

        env = self.env
        if self.traj is None or self.last is None:
            prompt_ids = env.prompt_ids(messages, tools)
            self.traj = Trajectory(prompt_ids)
        else:
            n = len(self.sent)
            if _said(messages[:n]) != _said(self.sent):
                raise ConfigError(
                    f"verifiers environment {env.name!r} changed earlier messages of an episode "
                    "between turns; its turns cannot be continued token-exactly"
                )
            self.traj.add_env(env.chat.ids(messages[n:], after=self.last))
        room = min(
            env.generation.max_completion_length, env.max_episode_tokens - len(self.traj.ids)
        )
        if room < 1:
            raise OverlongPromptError(
                f"the episode reached max_episode_tokens={env.max_episode_tokens}"
            )
        turns = await self.policy.complete(
            self.traj.ids,
            seed=env.seed(self.task, self.index, self.traj.model_turns),
            max_tokens=room,
            session=env.session(self.task),
        )
        if not turns:  # counted by the policy client; verifiers ends the episode here
            raise _NoLogprobs("a model turn came back without usable logprobs")
        turn = self.last = turns[0]
        self.traj.add_turn(turn)
        calls = parse_tool_calls(turn.text) if tools else []
        answer: Message = {"role": "assistant", "content": turn.text}
        if calls:
            answer["tool_calls"] = calls
        self.sent = [*messages, answer]
        return ChatCompletion.model_validate(
            {
                "id": f"asyncgrpo-{self.task.index}-{self.index}",
                "object": "chat.completion",
                "created": 0,
                "model": self.policy.model,
                "prompt_token_ids": turn.prompt_ids,
                "choices": [
                    {
                        "index": 0,
                        "message": {
                            "role": "assistant",
                            "content": turn.text,
                            "tool_calls": calls or None,
                        },
                        "finish_reason": "length" if turn.finish_reason == "length" else "stop",
                        "token_ids": turn.token_ids,
                        "logprobs": {
                            "content": [
                                {"token": "", "logprob": lp, "bytes": None, "top_logprobs": []}
                                for lp in turn.logprobs
                            ]
                        },
                    }
                ],
            }
        )


def _said(messages: list[Message]) -> list[tuple[Any, Any]]:
    """Who said what: how two renderings of a conversation are compared."""
    return [(m.get("role"), m.get("content")) for m in messages]


class _NoLogprobs(Exception):
    pass


class _Client:
    """The part of ``AsyncOpenAI`` a chat environment calls."""

    def __init__(self, play: _Play) -> None:
        self.chat = _Namespace(completions=_Namespace(create=play.create))


class _Namespace:
    def __init__(self, **attrs: Any) -> None:
        self.__dict__.update(attrs)


class VerifiersEnv(Environment):
    """A verifiers chat environment: its rollouts, its rubric's rewards, asyncgrpo's tokens.

    ``name`` and ``args``: what ``verifiers.load_environment`` gets. ``max_episode_tokens``
    bounds the whole sequence (keep it at most the replicas' ``--max-model-len``); a turn gets
    at most what is left, and the environment sees an overlong prompt when nothing is.
    The dataset rows come from the run's ``dataset`` section: ``prompt`` (messages) and the
    columns the environment's rubric reads (``answer``, ``info``), as its own dataset has them.
    """

    provides_reward = True

    def __init__(
        self,
        *,
        tokenizer: Any,
        generation: GenerationConfig,
        name: str,
        args: Mapping[str, Any] | None = None,
        max_episode_tokens: int = 1024,
    ) -> None:
        super().__init__(tokenizer=tokenizer, generation=generation)
        try:
            import verifiers
        except ImportError as exc:
            raise ConfigError(
                f"rollout.environment={{verifiers: {name!r}}} needs the verifiers package: "
                f"pip install 'asyncgrpo[envs]' ({exc})"
            ) from exc
        try:
            env = verifiers.load_environment(name, **dict(args or {}))
        except Exception as exc:  # verifiers wraps whatever the module raised in RuntimeError
            raise ConfigError(
                f"verifiers environment {name!r}: {type(exc).__name__}: {exc}"
            ) from exc
        if not isinstance(env, verifiers.MultiTurnEnv) or env.message_type != "chat":
            raise ConfigError(
                f"verifiers environment {name!r} is a {type(env).__name__} with message_type "
                f"{getattr(env, 'message_type', None)!r}: only chat environments built on "
                "MultiTurnEnv (SingleTurnEnv, ToolEnv, ...) can be played token-exactly"
            )
        if max_episode_tokens < 2:
            raise ConfigError(f"VerifiersEnv: max_episode_tokens={max_episode_tokens} must be >= 2")
        self.name, self.env, self.max_episode_tokens = name, env, max_episode_tokens
        self.chat = ChatContinuation(tokenizer)

    @staticmethod
    def stack() -> str:
        """Which verifiers is installed: ``v1`` (0.4 and later, ``verifiers.v1``) or ``v0``."""
        from importlib.metadata import version

        major_minor = tuple(int(p) for p in version("verifiers").split(".")[:2] if p.isdigit())
        return "v1" if major_minor >= (0, 4) else "v0"

    @staticmethod
    def find(name: str) -> None:
        """Raise ``ConfigError`` unless ``verifiers`` and the environment module ``name`` are
        installed (found, not imported: importing loads the environment)."""
        module = name.replace("-", "_").split("/")[-1]
        needs = [
            ("verifiers", "pip install 'asyncgrpo[envs]'"),
            (module, f"install the environment's package (module {module!r})"),
        ]
        for what, hint in needs:
            try:
                found = importlib.util.find_spec(what) is not None
            except (ImportError, ValueError):
                found = False
            if not found:
                raise ConfigError(
                    f"rollout.environment={{verifiers: {name!r}}}: {what} is not installed: {hint}"
                )

    def prompt_ids(self, messages: list[Message], tools: Any) -> list[int]:
        """The first turn's ids: the messages through the chat template, with the tools."""
        if not tools:
            return encode_prompt(self.tokenizer, messages)
        text = self.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=False
        )
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    async def group(self, task: Prompt, policy: PolicyClient, g: int) -> list[Episode]:
        """G rollouts at once, scored together by the environment's rubric (group rewards)."""
        played: list[tuple[_Play, Any] | None] = [None] * g

        async def one(i: int) -> None:
            played[i] = await self._play(task, policy, i)

        async with anyio.create_task_group() as tg:
            for i in range(g):
                tg.start_soon(one, i)
        done = [p for p in played if p is not None]
        if done:
            await self.env.rubric.score_group([s for _, s in done])
        return [self._episode(task, play, state) for play, state in done]

    async def rollout(self, task: Prompt, policy: PolicyClient, index: int) -> Episode | None:
        played = await self._play(task, policy, index)
        if played is None:
            return None
        await self.env.rubric.score_group([played[1]])
        return self._episode(task, *played)

    async def _play(
        self, task: Prompt, policy: PolicyClient, index: int
    ) -> tuple[_Play, Any] | None:
        from verifiers import OverlongPromptError

        play = _Play(self, task, policy, index)
        prompt = task.prompt if task.is_chat else [{"role": "user", "content": task.prompt}]
        row = {**task.extra, "prompt": prompt, "example_id": task.index}
        state = await self.env.rollout(row, _Client(play), policy.model, {})
        if play.error is not None:
            raise play.error
        if play.traj is None or not play.traj.model_turns:
            if state.get("error") is not None:
                logger.warning("verifiers episode of task %d lost: %r", task.index, state["error"])
            return None
        error = state.get("error")
        if error is not None and not isinstance(error.__cause__, OverlongPromptError | _NoLogprobs):
            # a tool or parser failure: the episode ends there, as verifiers ends it
            logger.warning("verifiers episode of task %d ended on %r", task.index, error)
        return play, state

    @staticmethod
    def _episode(task: Prompt, play: _Play, state: Any) -> Episode:
        assert play.traj is not None
        completion = list(state.get("completion") or [])
        reward = state.get("reward")
        return play.traj.episode(completion, None if reward is None else float(reward))
