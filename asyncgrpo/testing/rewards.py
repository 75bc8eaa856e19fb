"""Reward functions for the synthetic CPU task (the demo and the learning test).

A random tiny model samples nearly uniformly over its ~380 tokens, a few percent of which
contain digits, so a random policy sometimes earns a reward and a group of G completions has
variance to learn from. Raising the share of digit characters is a direction the LoRA can find
quickly (push probability mass onto a small set of tokens), so the reward rises within tens of
steps on 2 CPU cores.
"""

from __future__ import annotations

import os
import time
from typing import Any

#: A file whose absence holds :func:`gated_digit_fraction` (tests pause a run's scoring).
GATE_ENV = "ASYNCGRPO_TEST_REWARD_GATE"


def _text(completion: Any) -> str:
    if isinstance(completion, list):  # chat form: [{"role": "assistant", "content": ...}]
        return "".join(m.get("content", "") for m in completion)
    return str(completion)


def digit_fraction(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
    """Share of the completion's non-space characters that are digits (0 for an empty one)."""
    out = []
    for completion in completions:
        chars = [c for c in _text(completion) if not c.isspace()]
        out.append(sum(c.isdigit() for c in chars) / len(chars) if chars else 0.0)
    return out


def always_fails(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
    """A reward function that raises: the run must count it and go on."""
    raise RuntimeError("this reward function always fails")


def gated_digit_fraction(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
    """:func:`digit_fraction`, once the file ``$ASYNCGRPO_TEST_REWARD_GATE`` names exists (at
    once if the variable is unset): a test holds a run between two steps by removing the file,
    e.g. until a replica it started has joined, without touching the run's processes. Runs in a
    worker thread, as plain reward functions do."""
    gate = os.environ.get(GATE_ENV)
    while gate and not os.path.exists(gate):
        time.sleep(0.2)
    return digit_fraction(prompts, completions)
