"""Multi-turn environments for the tiny CPU model: a calculator tool task it can learn, and a
fixed-length conversation for exactness tests.

The tiny model is random, so the tool protocol is one it can stumble into: a model turn that
contains the word ``add`` calls the calculator, and the environment answers with the sum as a
``tool`` message; without a call it answers as the user, asking for one. The reward (from the
environment, no reward function needed) has two parts a rank-1 LoRA can push up within tens of
steps: ``tool_call`` (0.5 once the calculator was called) and ``answer`` (after the call, 0.5 x
the share of digits in the model's last turn, or 1.0 when it contains the right sum).
"""

from __future__ import annotations

import random
import re
from typing import Any

import anyio

from asyncgrpo.rollout.dataset import Prompt
from asyncgrpo.rollout.environment import Episode, Message, MultiTurnEnv
from asyncgrpo.rollout.policy import PolicyClient

_CALL = re.compile(r"\badd\b")


def calculator_tasks(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """Dataset rows for :class:`CalculatorEnv`: a chat prompt asking for ``a + b``, a, b, and
    the sum as ``answer`` (the column verifiers' rubrics read)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 49), rng.randint(0, 49)
        rows.append(
            {
                "prompt": [
                    {"role": "system", "content": "you can add with the calculator: say add"},
                    {"role": "user", "content": f"what is {a} plus {b}"},
                ],
                "a": a,
                "b": b,
                "answer": str(a + b),
            }
        )
    return rows


def _digit_share(text: str) -> float:
    chars = [c for c in text if not c.isspace()]
    return sum(c.isdigit() for c in chars) / len(chars) if chars else 0.0


class CalculatorEnv(MultiTurnEnv):
    """Ask for a sum; the model may call the calculator (say ``add``); then it answers."""

    provides_reward = True

    async def setup(self, task: Prompt) -> dict[str, Any]:
        return {"sum": int(task.extra["a"]) + int(task.extra["b"]), "called": False}

    async def env_response(
        self, task: Prompt, messages: list[Message], state: dict[str, Any]
    ) -> list[Message] | None:
        if state["called"]:
            return None  # the turn after the tool result is the answer
        if _CALL.search(messages[-1]["content"]):
            state["called"] = True
            return [{"role": "tool", "content": str(state["sum"])}]
        return [{"role": "user", "content": "use the calculator: say add"}]

    async def reward(
        self, task: Prompt, messages: list[Message], state: dict[str, Any]
    ) -> dict[str, float]:
        if not state["called"] or messages[-1]["role"] != "assistant":
            return {"tool_call": 0.0, "answer": 0.0}
        answer = messages[-1]["content"]
        correct = re.search(rf"(?<!\d){state['sum']}(?!\d)", answer) is not None
        return {"tool_call": 0.5, "answer": 1.0 if correct else 0.5 * _digit_share(answer)}


class ChatterEnv(MultiTurnEnv):
    """``max_turns`` model turns, each answered by the same user message: a fixed shape for
    tests of token masks, versions and logprobs over whole episodes. Rewards the share of digit
    characters over the model's turns (so groups have variance to learn from).

    ``straddle_s``: episodes of odd-index prompts hold their first reply until the policy's
    adapter version is newer than the one they started under (at most that many seconds), so
    they straddle a weight sync whatever the machine's speed; even-index prompts answer at once,
    so the run keeps training and publishing meanwhile."""

    provides_reward = True

    def __init__(self, *, straddle_s: float = 0.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.straddle_s = straddle_s
        self._policy: PolicyClient | None = None

    async def group(self, task: Prompt, policy: PolicyClient, g: int) -> list[Episode]:
        self._policy = policy  # one client serves all of a run's episodes
        return await super().group(task, policy, g)

    async def setup(self, task: Prompt) -> dict[str, Any]:
        held = self.straddle_s > 0 and task.index % 2 == 1 and self._policy is not None
        return {"started_at": self._policy.version if held else None}

    async def env_response(
        self, task: Prompt, messages: list[Message], state: dict[str, Any]
    ) -> list[Message] | None:
        started, policy = state.pop("started_at", None), self._policy
        if started is not None and policy is not None:
            with anyio.move_on_after(self.straddle_s):
                # the version is the trainer's callable's value: there is no event to wait on
                while policy.version <= started:  # noqa: ASYNC110
                    await anyio.sleep(0.05)
        return [{"role": "user", "content": "go on"}]

    async def reward(self, task: Prompt, messages: list[Message], state: dict[str, Any]) -> float:
        return _digit_share("".join(m["content"] for m in messages if m["role"] == "assistant"))
