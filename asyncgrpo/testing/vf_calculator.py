"""A verifiers environment module for the tiny CPU model: the calculator task of
:mod:`asyncgrpo.testing.envs`, written with verifiers' own classes (needs ``asyncgrpo[envs]``).

``rollout.environment: {verifiers: asyncgrpo.testing.vf_calculator, args: {kind: ...}}``:

* ``single``: a ``SingleTurnEnv``: one answer per episode.
* ``multi``: a ``MultiTurnEnv`` whose user asks again after each answer, for ``max_turns``
  model turns (the conversation is checked token-exactly turn after turn).
* ``tool``: a ``ToolEnv`` with an ``add(a, b)`` tool, called the Hermes/Qwen way
  (``<tool_call>{"name": "add", "arguments": {...}}</tool_call>``).

The rubric rewards the share of digits in the last answer (0.5 at most) plus 1.0 when it holds
the sum (the ``answer`` column). The environment's own dataset is ``calculator_tasks(64)``, the
rows of ``examples/calculator_tasks.jsonl``; asyncgrpo plays the rows of the run's dataset.
"""

from __future__ import annotations

from typing import Any, Literal

import verifiers as vf
from datasets import Dataset

from asyncgrpo.testing.envs import calculator_tasks


def _last_text(completion: Any) -> str:
    if isinstance(completion, str):
        return completion
    said = [m.get("content") or "" for m in completion or [] if m.get("role") == "assistant"]
    return said[-1] if said else ""


def digits(completion: Any, **_: Any) -> float:
    """Half the share of digits among the last answer's non-blank characters."""
    chars = [c for c in _last_text(completion) if not c.isspace()]
    return 0.5 * sum(c.isdigit() for c in chars) / len(chars) if chars else 0.0


def correct_sum(completion: Any, answer: str, **_: Any) -> float:
    return float(bool(answer) and answer in _last_text(completion))


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first integer
        b: the second integer
    """
    return a + b


class AskAgain(vf.MultiTurnEnv):
    """The user asks for the sum again after every answer, until ``max_turns``."""

    async def env_response(self, messages: vf.Messages, state: vf.State, **_: Any) -> vf.Messages:
        return [{"role": "user", "content": "say the sum again, digits only"}]


def load_environment(
    kind: Literal["single", "multi", "tool"] = "multi", max_turns: int = 3
) -> vf.Environment:
    rubric = vf.Rubric(funcs=[digits, correct_sum], weights=[1.0, 1.0])
    # verifiers wants a dataset; asyncgrpo plays the rows of the run's own dataset section
    tasks = Dataset.from_list(calculator_tasks(64))
    if kind == "single":
        return vf.SingleTurnEnv(dataset=tasks, rubric=rubric)
    if kind == "multi":
        return AskAgain(dataset=tasks, rubric=rubric, max_turns=max_turns)
    if kind == "tool":
        return vf.ToolEnv(tools=[add], dataset=tasks, rubric=rubric, max_turns=max_turns)
    raise ValueError(f"kind={kind!r}: use single, multi or tool")
