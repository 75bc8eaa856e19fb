"""Token-exact model turns for chat conversations that an outside program drives.

A harness (verifiers' chat loop, an agent) sends the whole conversation each turn, as OpenAI
chat messages. Rendered again through the chat template, the ids the trainer sees would not be
those the policy sampled. :class:`ChatTurns` answers it token-exactly: the first turn is the
conversation through the model's chat template (with the tools), every later turn the previous
turn's exact ids, the ids vLLM sampled and only the new messages rendered once
(:class:`~asyncgrpo.rollout.environment.ChatContinuation`), sent through asyncgrpo's policy
client as token ids. Each conversation's record lives on its :class:`Seat`.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Mapping
from typing import Any

import anyio

from asyncgrpo.errors import EpisodeError
from asyncgrpo.rollout.dataset import Prompt, encode_prompt
from asyncgrpo.rollout.environment import (
    ChatContinuation,
    Environment,
    Episode,
    Message,
    Trajectory,
)
from asyncgrpo.rollout.policy import PolicyClient, Turn
from asyncgrpo.rollout.verifiers_env import parse_tool_calls

__all__ = ["ChatTurns", "PlayedEnv", "Seat", "TurnRefused", "episode_of"]


class TurnRefused(Exception):
    """A model call that cannot be answered token-exactly; ``status`` is the HTTP status a
    harness should see (400: its request; 502: the model's answer was unusable)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class Seat:
    """One conversation's part in an episode: who samples its turns, under which
    ``X-Session-ID`` and seeds, and its token record."""

    def __init__(
        self, policy: PolicyClient, session: str | None, seed: Callable[[int], int | None]
    ) -> None:
        self.policy, self.session, self.seed = policy, session, seed
        self.traj: Trajectory | None = None
        self.prompt_messages = 0
        self.tools: Any = None  # what the first turn offered (OpenAI's function form)
        self.sent: list[Message] = []  # the conversation of the last turn, with its answer
        self.last: Turn | None = None
        #: an error of asyncgrpo's side (a replica failure): a harness would turn it into an
        #: episode error; the environment re-raises it so that it stops the run
        self.error: Exception | None = None

    def completion(self) -> list[Message]:
        """The messages after the prompt, up to the last answer."""
        return self.sent[self.prompt_messages :]


class ChatTurns:
    """Answers chat turns token-exactly; ``max_tokens`` per turn, ``max_episode_tokens`` for
    the whole sequence (keep it at most the replicas' ``--max-model-len``)."""

    def __init__(self, *, tokenizer: Any, max_tokens: int, max_episode_tokens: int) -> None:
        self.tokenizer, self.max_tokens = tokenizer, max_tokens
        self.max_episode_tokens = max_episode_tokens
        self.chat = ChatContinuation(tokenizer)

    async def answer(
        self, seat: Seat, messages: list[Message], tools: list[dict[str, Any]] | None
    ) -> tuple[Turn, list[dict[str, Any]]]:
        """The model's turn and its tool calls (OpenAI's form, read from the text)."""
        if any(isinstance(m.get("content"), list) for m in messages):
            raise TurnRefused("a message has content parts (multimodal): asyncgrpo plays text")
        traj = self._extend(seat, messages, tools)
        room = min(self.max_tokens, self.max_episode_tokens - len(traj.ids))
        if room < 1:
            raise TurnRefused(f"the episode reached max_episode_tokens={self.max_episode_tokens}")
        turns = await seat.policy.complete(
            traj.ids, seed=seat.seed(traj.model_turns), max_tokens=room, session=seat.session
        )
        if not turns:
            raise TurnRefused("a model turn came back without usable logprobs", 502)
        got = seat.last = turns[0]
        traj.add_turn(got)
        calls = parse_tool_calls(got.text) if tools else []
        answer: Message = {"role": "assistant", "content": got.text}
        if calls:
            answer["tool_calls"] = calls
        seat.sent = [*messages, answer]
        return got, calls

    def _extend(self, seat: Seat, messages: list[Message], tools: Any) -> Trajectory:
        """The ids to send: the first turn's prompt, or the last turn's sequence plus the new
        messages rendered once."""
        if seat.traj is None:
            seat.traj = Trajectory(self._prompt_ids(messages, tools))
            seat.prompt_messages, seat.tools = len(messages), tools
            return seat.traj
        n = len(seat.sent)
        if _said(messages[:n]) != _said(seat.sent) or seat.last is None:
            raise TurnRefused(
                "the harness changed earlier messages of an episode between turns; its turns "
                "cannot be continued token-exactly"
            )
        seat.traj.add_env(self.chat.ids(messages[n:], after=seat.last))
        return seat.traj

    def _prompt_ids(self, messages: list[Message], tools: Any) -> list[int]:
        if not tools:
            return encode_prompt(self.tokenizer, messages)
        text = self.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=False
        )
        return list(self.tokenizer.encode(text, add_special_tokens=False))


def _said(messages: list[Message]) -> list[tuple[Any, str]]:
    """Who said what: how two renderings of a conversation are compared."""
    return [(m.get("role"), str(m.get("content") or "")) for m in messages]


def episode_of(result: Mapping[str, Any], seats: Mapping[str, Seat]) -> Episode | str:
    """The episode trained on, from an episode's outcome (its error, each trace's rewards)
    and the seats that answered its traces; or why it is unusable."""
    if result.get("error"):
        return str(result["error"])
    traces = [t for t in result["traces"] if (s := seats.get(t["id"])) and s.traj]
    if len(traces) != 1:
        return f"an episode with {len(traces)} model-calling agent runs (asyncgrpo trains one)"
    seat = seats[traces[0]["id"]]
    if seat.traj is None or not seat.traj.model_turns:
        return "an episode without a model turn"
    parts = {str(k): float(v) for k, v in traces[0]["rewards"].items()}
    if not parts:
        return "an episode without a reward"
    return seat.traj.episode(seat.completion(), parts)


class PlayedEnv(Environment):
    """An environment whose episodes an outside program plays (``name`` in messages): G at
    once, and the first unusable one costs the whole group (:class:`EpisodeError`)."""

    provides_reward = True
    name = ""

    @abstractmethod
    async def _play(self, task: Prompt, policy: PolicyClient, index: int) -> Episode | str:
        """The episode, or why it is unusable (the environment's own message)."""

    async def group(self, task: Prompt, policy: PolicyClient, g: int) -> list[Episode]:
        results: list[Episode | str | None] = [None] * g

        async def one(i: int) -> None:
            results[i] = await self._play(task, policy, i)

        async with anyio.create_task_group() as tg:
            for i in range(g):
                tg.start_soon(one, i)
        failed = [r for r in results if isinstance(r, str)]
        if failed:
            raise EpisodeError(f"verifiers environment {self.name!r}: {failed[0]}")
        return [r for r in results if isinstance(r, Episode)]

    async def rollout(self, task: Prompt, policy: PolicyClient, index: int) -> Episode | None:
        played = await self._play(task, policy, index)
        if isinstance(played, str):
            raise EpisodeError(f"verifiers environment {self.name!r}: {played}")
        return played
