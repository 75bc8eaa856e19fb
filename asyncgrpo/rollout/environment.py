"""Environments: how a task becomes a group of scored episodes.

An environment gets a task (a dataset :class:`~asyncgrpo.rollout.dataset.Prompt`) and a
:class:`~asyncgrpo.rollout.policy.PolicyClient` bound to the current adapter version through the
proxy, and returns :class:`Episode` s: the token ids of the whole sequence, which of them the
policy produced (``completion_mask``), the behaviour logprob of each policy token, the adapter
version of each token, and optionally its reward(s) (else the run's reward functions score it).

* :class:`SingleTurnEnv` (the default) is today's GRPO rollout: one request with ``n=G`` per
  task (vLLM prefills once and forks), or G requests with ``n=1``.
* :class:`MultiTurnEnv` alternates model turns and environment messages (a tool result, a
  user's reply) until :meth:`MultiTurnEnv.env_response` returns ``None`` or ``max_turns``. Each
  turn's prompt is the previous turn's exact token ids plus the environment's message tokenized
  once (:class:`ChatContinuation`), and vLLM's echo of the prompt ids is checked against it, so
  the trainer sees precisely the ids vLLM generated: re-rendering the conversation through the
  chat template would silently change them (a different BPE split, a normalised whitespace).

Write an environment by subclassing one of them; name it in the config as
``rollout.environment: "package.module:Class"`` with ``rollout.environment_args``.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import math
import secrets
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import anyio

from asyncgrpo.config.rollout import GenerationConfig
from asyncgrpo.errors import ConfigError, ReplicaError
from asyncgrpo.rollout.dataset import Prompt
from asyncgrpo.rollout.policy import PolicyClient, Turn
from asyncgrpo.rollout.rewards import GroupScores, RewardScorer

__all__ = [
    "ChatContinuation",
    "Environment",
    "Episode",
    "Message",
    "MultiTurnEnv",
    "SingleTurnEnv",
    "Trajectory",
    "combine_reward",
    "environment_class",
    "group_rewards",
    "load_environment",
]

Message = dict[str, Any]


@dataclass(slots=True, kw_only=True)
class Episode:
    """One finished episode, before scoring; see :class:`~asyncgrpo.sample.Sample` for the
    meaning of the token fields (``None`` masks and versions: single-turn)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    version: int
    completion_mask: list[bool] | None = None
    versions: list[int] | None = None
    #: What reward functions see as the completion: the text (plain-text single-turn prompt)
    #: or the messages after the prompt (chat: TRL's ``[{"role": "assistant", ...}, ...]``).
    completion: str | list[Message] = ""
    finish_reason: str | None = None
    model_turns: int = 1
    #: The replica that served each model turn, as the proxy names it (None without a proxy).
    replicas: list[str | None] | None = None
    #: The environment's own reward (a number or named parts, summed); None: reward functions.
    reward: float | Mapping[str, float] | None = None

    @property
    def served_by(self) -> str | None:
        """The replica(s) that served the model turns, in turn order without repeats, joined by
        ``+`` (None when no turn was named: no proxy in front)."""
        names = list(dict.fromkeys(r for r in self.replicas or () if r))
        return "+".join(names) if names else None


class Trajectory:
    """Builds an episode turn by turn, holding the exact token ids to send next (``ids``).

    :meth:`add_turn` refuses a turn whose prompt, as vLLM echoed it, is not ``ids``: then the
    server saw other tokens than the trainer will, and the logprobs would be of another sequence.
    """

    def __init__(self, prompt_ids: Sequence[int]) -> None:
        self.prompt_ids = list(prompt_ids)
        self.ids = list(prompt_ids)
        self.completion_ids: list[int] = []
        self.logprobs: list[float] = []
        self.mask: list[bool] = []
        self.versions: list[int] = []
        self.model_turns = 0
        self.finish_reason: str | None = None
        self.replicas: list[str | None] = []

    def add_turn(self, turn: Turn) -> None:
        if turn.prompt_ids != self.ids:
            raise ReplicaError(
                f"turn {self.model_turns + 1}: the server answered for a prompt of "
                f"{len(turn.prompt_ids)} tokens that differs from the {len(self.ids)} sent; the "
                "episode's token ids would not be the ones the logprobs belong to"
            )
        n = len(turn.token_ids)
        self.ids += turn.token_ids
        self.completion_ids += turn.token_ids
        self.logprobs += turn.logprobs
        self.mask += [True] * n
        self.versions += [turn.version] * n
        self.model_turns += 1
        self.finish_reason = turn.finish_reason
        self.replicas.append(turn.replica)

    def add_env(self, token_ids: Sequence[int]) -> None:
        """Environment tokens: no loss; tagged with the version of the turn before them."""
        n = len(token_ids)
        self.ids += token_ids
        self.completion_ids += token_ids
        self.logprobs += [0.0] * n
        self.mask += [False] * n
        self.versions += [self.versions[-1] if self.versions else 0] * n

    def episode(self, completion: str | list[Message], reward: Any = None) -> Episode:
        if not self.model_turns:
            raise ValueError("an episode needs at least one model turn")
        return Episode(
            prompt_ids=self.prompt_ids,
            completion_ids=self.completion_ids,
            logprobs=self.logprobs,
            version=min(self.versions),
            completion_mask=self.mask,
            versions=self.versions,
            completion=completion,
            finish_reason=self.finish_reason,
            model_turns=self.model_turns,
            replicas=self.replicas,
            reward=reward,
        )


class ChatContinuation:
    """Token ids that continue a conversation after a model turn with new messages.

    Rendered with the model's chat template once per call, from a sentinel conversation, so the
    text between the end of an assistant message and the next generation prompt is the
    template's own (``<|im_end|>\\n<|im_start|>tool\\n...<|im_end|>\\n<|im_start|>assistant\\n``
    for Qwen-style templates). When the model stopped on a token the template writes at the end
    of a message (its end-of-turn token, whichever of the model's stop tokens that is), the token
    is not repeated; a turn cut by ``max_tokens`` gets the template's whole closing text.
    """

    _SENTINEL = "\x00asyncgrpo-sentinel\x00"

    def __init__(self, tokenizer: Any) -> None:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ConfigError(
                "a multi-turn environment renders its messages with the tokenizer's chat "
                "template, and this tokenizer has none: use a model with one"
            )
        self.tokenizer = tokenizer

    def text(self, messages: Sequence[Message], *, ended_with: str = "") -> str:
        """The text after a model turn whose last sampled token, decoded, is ``ended_with``
        (empty when the turn did not stop on a token)."""
        head: list[Message] = [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": self._SENTINEL},
        ]
        render = self.tokenizer.apply_chat_template
        before = render(head, tokenize=False, add_generation_prompt=False)
        after = render([*head, *messages], tokenize=False, add_generation_prompt=True)
        if not after.startswith(before):
            raise ConfigError(
                "the chat template renders a conversation differently once messages are added "
                "(it is not append-only), so a turn cannot be continued token-exactly"
            )
        tail = before[before.index(self._SENTINEL) + len(self._SENTINEL) :]
        if ended_with.strip() and tail.startswith(ended_with):
            tail = tail[len(ended_with) :]
        return tail + after[len(before) :]

    def ids(self, messages: Sequence[Message], *, after: Turn) -> list[int]:
        """Ids of ``messages`` appended after the model turn ``after``."""
        last = ""
        if after.finish_reason == "stop" and after.token_ids:
            last = self.tokenizer.decode([after.token_ids[-1]], skip_special_tokens=False)
        text = self.text(messages, ended_with=last)
        return list(self.tokenizer.encode(text, add_special_tokens=False))


class Environment(ABC):
    """Turns one task into a group of episodes (G of them, fewer if some failed).

    Subclasses set ``provides_reward = True`` when their episodes carry a reward; otherwise the
    run's ``rollout.reward_funcs`` score them. ``tokenizer`` is the model's (None when the
    caller has none, e.g. pre-tokenised prompts; single-turn needs none).
    """

    provides_reward = False

    def __init__(self, *, tokenizer: Any, generation: GenerationConfig) -> None:
        self.tokenizer = tokenizer
        self.generation = generation
        self._sessions = secrets.token_hex(4)  # tells apart clients that share a proxy

    def session(self, task: Prompt) -> str | None:
        """The ``X-Session-ID`` sent with every turn of ``task``'s G episodes (None: none).

        One per group, not per episode: the proxy keeps all of them on the replica that served
        the group's first turn, which holds their shared prompt and each episode's turns so far
        (within its load bound). Without it the proxy can only match prefixes, and a turn's
        prompt ends in a block the previous prompt held only partially.
        """
        return f"{self._sessions}-{task.index}"

    def seed(self, task: Prompt, episode: int, turn: int = 0) -> int | None:
        """Sampling seed of turn ``turn`` of episode ``episode`` (None when unseeded): turn 0
        draws ``seed + position * G + episode``, as a single-turn rollout does."""
        base = self.generation.seed
        if base is None:
            return None
        g = self.generation.num_generations
        return base + task.index * g + episode + turn * 1_000_003

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Resources the environment holds while the rollout client runs (servers, tool
        processes); the client enters it before the first group and leaves it last."""
        yield

    async def group(self, task: Prompt, policy: PolicyClient, g: int) -> list[Episode]:
        """G episodes of ``task``, run concurrently."""
        results: list[Episode | None] = [None] * g

        async def one(i: int) -> None:
            results[i] = await self.rollout(task, policy, i)

        async with anyio.create_task_group() as tg:
            for i in range(g):
                tg.start_soon(one, i)
        return [e for e in results if e is not None]

    @abstractmethod
    async def rollout(self, task: Prompt, policy: PolicyClient, index: int) -> Episode | None:
        """Episode number ``index`` of ``task`` (None: lost, e.g. unusable logprobs)."""


class SingleTurnEnv(Environment):
    """One completion per episode; one ``n=G`` request per group (``request_mode='n'``)."""

    async def group(self, task: Prompt, policy: PolicyClient, g: int) -> list[Episode]:
        if self.generation.request_mode == "n":
            turns = await policy.complete(task.prompt_ids, n=g, seed=self.seed(task, 0))
            return [self._episode(task, t) for t in turns]
        return await super().group(task, policy, g)

    async def rollout(self, task: Prompt, policy: PolicyClient, index: int) -> Episode | None:
        turns = await policy.complete(task.prompt_ids, seed=self.seed(task, index))
        return self._episode(task, turns[0]) if turns else None

    @staticmethod
    def _episode(task: Prompt, turn: Turn) -> Episode:
        return Episode(
            prompt_ids=turn.prompt_ids,
            completion_ids=turn.token_ids,
            logprobs=turn.logprobs,
            version=turn.version,
            completion=[{"role": "assistant", "content": turn.text}] if task.is_chat else turn.text,
            finish_reason=turn.finish_reason,
            replicas=[turn.replica],
        )


class MultiTurnEnv(Environment):
    """Model turns alternating with the environment's messages, token-exact.

    Override :meth:`env_response` (and :meth:`reward` with ``provides_reward = True`` to score
    episodes yourself). ``max_turns`` bounds model turns; ``max_episode_tokens`` bounds the
    whole sequence (keep it at most the replicas' ``--max-model-len``): a turn gets at most what
    is left, and the episode ends when nothing is. With ``request_mode='n'`` the first turn of
    the G episodes is one ``n=G`` request (one prefill); later turns diverge.
    """

    def __init__(
        self,
        *,
        tokenizer: Any,
        generation: GenerationConfig,
        max_turns: int = 4,
        max_episode_tokens: int = 1024,
    ) -> None:
        super().__init__(tokenizer=tokenizer, generation=generation)
        if max_turns < 1 or max_episode_tokens < 2:
            raise ConfigError(
                f"{type(self).__name__}: max_turns={max_turns} must be >= 1 and "
                f"max_episode_tokens={max_episode_tokens} >= 2"
            )
        self.max_turns = max_turns
        self.max_episode_tokens = max_episode_tokens
        self.chat = ChatContinuation(tokenizer)

    async def setup(self, task: Prompt) -> dict[str, Any]:
        """Per-episode state handed to :meth:`env_response` and :meth:`reward`."""
        return {}

    @abstractmethod
    async def env_response(
        self, task: Prompt, messages: list[Message], state: dict[str, Any]
    ) -> list[Message] | None:
        """The messages that answer the model's last turn (``messages[-1]``), or None to end."""

    async def reward(
        self, task: Prompt, messages: list[Message], state: dict[str, Any]
    ) -> float | Mapping[str, float] | None:
        """The episode's reward (needs ``provides_reward = True``); None: reward functions."""
        return None

    def _room(self, traj: Trajectory) -> int:
        return min(self.generation.max_completion_length, self.max_episode_tokens - len(traj.ids))

    async def group(self, task: Prompt, policy: PolicyClient, g: int) -> list[Episode]:
        if self.generation.request_mode != "n":
            return await super().group(task, policy, g)
        room = self._room(Trajectory(task.prompt_ids))
        if room < 1:
            return []
        first = await policy.complete(
            task.prompt_ids,
            n=g,
            seed=self.seed(task, 0),
            max_tokens=room,
            session=self.session(task),
        )
        results: list[Episode | None] = [None] * len(first)

        async def one(i: int) -> None:
            results[i] = await self._play(task, policy, i, first[i])

        async with anyio.create_task_group() as tg:
            for i in range(len(first)):
                tg.start_soon(one, i)
        return [e for e in results if e is not None]

    async def rollout(self, task: Prompt, policy: PolicyClient, index: int) -> Episode | None:
        return await self._play(task, policy, index, None)

    async def _play(
        self, task: Prompt, policy: PolicyClient, index: int, first: Turn | None
    ) -> Episode | None:
        traj = Trajectory(task.prompt_ids)
        messages: list[Message] = []
        state = await self.setup(task)
        session = self.session(task)
        turn = first
        while True:
            if turn is None:
                room = self._room(traj)
                if room < 1:
                    break
                turns = await policy.complete(
                    traj.ids,
                    seed=self.seed(task, index, traj.model_turns),
                    max_tokens=room,
                    session=session,
                )
                if not turns:
                    if not traj.model_turns:
                        return None
                    break  # unusable logprobs: the episode ends at the last good turn
                turn = turns[0]
            traj.add_turn(turn)
            messages.append({"role": "assistant", "content": turn.text})
            if traj.model_turns >= self.max_turns:
                break
            reply = await self.env_response(task, messages, state)
            if not reply:
                break
            reply_ids = self.chat.ids(reply, after=turn)
            if len(traj.ids) + len(reply_ids) >= self.max_episode_tokens:
                break  # no room left for another model turn after this message
            traj.add_env(reply_ids)
            messages.extend(reply)
            turn = None
        reward = await self.reward(task, messages, state) if self.provides_reward else None
        return traj.episode(messages if task.is_chat else _plain(messages), reward)


def _plain(messages: list[Message]) -> str:
    return "".join(str(m.get("content") or "") for m in messages)


async def group_rewards(
    scorer: RewardScorer | None, prompt: Prompt, episodes: Sequence[Episode]
) -> GroupScores:
    """Rewards of a group: the environment's (its named parts, or ``environment``) plus the
    reward functions' weighted sum when any are configured (NaN parts skipped)."""
    k = len(episodes)
    per_func: dict[str, list[float]] = {}
    totals: list[list[float]] = [[] for _ in range(k)]
    for j, e in enumerate(episodes):
        if e.reward is None:
            continue
        total, parts = combine_reward(e.reward)
        totals[j].append(total)
        for name, value in (parts or {"environment": total}).items():
            per_func.setdefault(name, [math.nan] * k)[j] = value
    if scorer is not None:
        kwargs: dict[str, Any] = {
            key: [value] * k
            for key, value in prompt.extra.items()
            if key not in ("prompts", "completions")
        }
        kwargs["prompt_ids"] = [e.prompt_ids for e in episodes]
        kwargs["completion_ids"] = [e.completion_ids for e in episodes]
        if any(e.completion_mask is not None for e in episodes):
            kwargs["completion_mask"] = [e.completion_mask for e in episodes]
        scores = await scorer.score([prompt.prompt] * k, [e.completion for e in episodes], **kwargs)
        per_func.update(scores.per_func)
        for j, r in enumerate(scores.rewards):
            totals[j].append(r)
    rewards = []
    for parts in totals:
        finite = [r for r in parts if not math.isnan(r)]
        rewards.append(math.fsum(finite) if finite else math.nan)
    return GroupScores(rewards=rewards, per_func=per_func)


def combine_reward(reward: float | Mapping[str, float]) -> tuple[float, dict[str, float]]:
    """An environment's reward as (total, named parts); non-finite parts make the total NaN."""
    if isinstance(reward, Mapping):
        parts = {str(k): float(v) for k, v in reward.items()}
        return math.fsum(parts.values()) if parts else math.nan, parts
    return float(reward), {}


def environment_class(path: str | Mapping[str, Any]) -> type[Environment]:
    """The class ``rollout.environment`` names (``'package.module:Class'``), imported; for
    ``{verifiers: NAME}``, :class:`~asyncgrpo.rollout.verifiers_env.VerifiersEnv` once
    ``verifiers`` and the module NAME are found (not imported: that loads the environment)."""
    if isinstance(path, Mapping) and path.get("python"):  # its own process and venv
        return environment_class("asyncgrpo.rollout.verifiers_remote:RemoteV1Env")
    if isinstance(path, Mapping):  # loaded by path like any environment: it builds on this module
        cls: Any = environment_class("asyncgrpo.rollout.verifiers_env:VerifiersEnv")
        cls.find(str(path["verifiers"]))
        if cls.stack() == "v1":
            return environment_class("asyncgrpo.rollout.verifiers_v1_env:VerifiersV1Env")
        return cls
    module_name, _, attr = path.partition(":")
    if module_name.partition(".")[0] == "verifiers":
        raise ConfigError(
            f"rollout.environment={path!r} is a verifiers class: name an installed verifiers "
            "environment as rollout.environment: {verifiers: NAME, args: {...}}"
        )
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except ImportError as exc:
        raise ConfigError(
            f"rollout.environment={path!r}: cannot import {module_name!r} ({exc}); check the "
            "path and that the module is installed or on PYTHONPATH"
        ) from exc
    except AttributeError as exc:
        raise ConfigError(f"rollout.environment={path!r}: no attribute {attr!r}") from exc
    if not (inspect.isclass(obj) and issubclass(obj, Environment)):
        raise ConfigError(
            f"rollout.environment={path!r} is not an asyncgrpo Environment subclass "
            "(asyncgrpo.rollout.environment.Environment)"
        )
    return obj


def load_environment(
    path: str | Mapping[str, Any] | None,
    args: Mapping[str, Any] | None,
    *,
    tokenizer: Any,
    generation: GenerationConfig,
) -> Environment:
    """The environment named by ``rollout.environment``, built with
    ``rollout.environment_args``; :class:`SingleTurnEnv` when ``path`` is None; a verifiers
    environment (``{verifiers: NAME, args: {...}}``) loaded with ``args``, played by
    :class:`~asyncgrpo.rollout.verifiers_env.VerifiersEnv` built with ``environment_args``."""
    args = dict(args or {})
    if path is None:
        if args:
            raise ConfigError(
                f"rollout.environment_args {sorted(args)} given without rollout.environment"
            )
        return SingleTurnEnv(tokenizer=tokenizer, generation=generation)
    cls = environment_class(path)
    if isinstance(path, Mapping):
        args.update(name=path["verifiers"], args=path.get("args"))
        if path.get("python"):
            args["python"] = path["python"]
    try:
        return cls(tokenizer=tokenizer, generation=generation, **args)
    except TypeError as exc:
        raise ConfigError(f"rollout.environment_args for {path}: {exc}") from exc
