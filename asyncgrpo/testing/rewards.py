"""Reward functions for the synthetic CPU task (the demo and the learning test).

A random tiny model samples nearly uniformly over its ~380 tokens, a few percent of which
contain digits, so a random policy sometimes earns a reward and a group of G completions has
variance to learn from. Raising the share of digit characters is a direction the LoRA can find
quickly (push probability mass onto a small set of tokens), so the reward rises within tens of
steps on 2 CPU cores.
"""

from __future__ import annotations

from typing import Any


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
