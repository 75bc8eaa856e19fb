"""Math answer reward: 1.0 when the completion's final answer equals the reference, else 0.0.

Parsing and equivalence are ``math-verify``'s (LaTeX and plain expressions, ``\\boxed{}``
preferred, sympy equivalence: ``0.5`` = ``\\frac{1}{2}``, ``(x+1)^2`` = ``x^2+2x+1``); install it
with the ``math`` extra. Config: ``rollout.reward_funcs: ["asyncgrpo.rewards.math:math_reward"]``.

The reference answer is read from the dataset row's columns (passed as keyword arguments, one
value per completion): ``answer``, else ``reward_model.ground_truth`` (verl-style rows), else
``solution``. A reference without ``$`` or ``\\boxed`` is treated as one LaTeX expression.

Why a process per check: sympy can hang on a pathological answer (``9^{9^{9^{9}}}`` never
finishes), and math-verify's own timeout uses ``signal.alarm``, which only works on a main
thread, while reward functions run beside the event loop. Each check therefore runs in an anyio
worker process under ``timeout_s``; on timeout the worker is killed and the answer scores 0.0.
Workers are reused, so the cost per check is one round trip, not a process start.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import anyio
import anyio.to_process

try:  # at import, so a config naming this reward fails at load (and --dry-run) when missing
    import math_verify
except ImportError as exc:
    raise ImportError(
        "asyncgrpo.rewards.math needs math-verify: pip install 'asyncgrpo[math]'"
    ) from exc

logger = logging.getLogger(__name__)

TIMEOUT_S = 10.0  # per completion: parse + verify


def reference_answers(n: int, kwargs: Mapping[str, Any]) -> list[str]:
    """The reference answer of each of ``n`` completions, from the dataset columns."""
    if kwargs.get("answer") is not None:
        values = kwargs["answer"]
    elif kwargs.get("reward_model") is not None:
        values = [row.get("ground_truth") if row else None for row in kwargs["reward_model"]]
    elif kwargs.get("solution") is not None:
        values = kwargs["solution"]
    else:
        raise ValueError(
            "math_reward needs the reference answer in a dataset column: 'answer', "
            "'reward_model' (with 'ground_truth') or 'solution'"
        )
    values = list(values)
    if len(values) != n:
        raise ValueError(f"{len(values)} reference answers for {n} completions")
    return [str(v) if v is not None else "" for v in values]


def completion_text(completion: str | Sequence[Mapping[str, Any]]) -> str:
    """A completion as text: plain, or the content of TRL's ``[{"role": ..., "content": ...}]``."""
    if isinstance(completion, str):
        return completion
    return "".join(str(m.get("content") or "") for m in completion)


def verify_answer(completion: str, reference: str) -> float:
    """1.0 if ``completion``'s answer is equivalent to ``reference``, 0.0 if not or unparseable.

    Runs in a worker process (see the module docstring), so math-verify's signal timeouts are
    off. A reference that does not parse is an error (the row is broken, not the completion).
    """
    text = reference.strip()
    if "$" not in text and "\\boxed" not in text:
        text = f"${text}$"
    gold = math_verify.parse(text, parsing_timeout=None)
    if not gold:
        raise ValueError(f"reference answer {reference!r} does not parse")
    answer = math_verify.parse(
        completion,
        extraction_config=[math_verify.LatexExtractionConfig(), math_verify.ExprExtractionConfig()],
        parsing_timeout=None,
    )
    if not answer:
        return 0.0
    return 1.0 if math_verify.verify(gold, answer, timeout_seconds=None) else 0.0


async def check_answer(completion: str, reference: str, *, timeout_s: float = TIMEOUT_S) -> float:
    """``verify_answer`` in a worker process; 0.0 (and the worker killed) after ``timeout_s``.

    The first check in a fresh worker also pays its imports (a few seconds), so keep
    ``timeout_s`` well above that.
    """
    with anyio.move_on_after(timeout_s):
        return await anyio.to_process.run_sync(
            verify_answer, completion, reference, cancellable=True
        )
    logger.warning(
        "math answer check took over %.0f s; scored 0 (answer ends %r)",
        timeout_s,
        completion[-200:],
    )
    return 0.0


async def math_reward(
    prompts: Sequence[Any],
    completions: Sequence[Any],
    *,
    timeout_s: float = TIMEOUT_S,
    **kwargs: Any,
) -> list[float]:
    """Reward function (``asyncgrpo.rewards.math:math_reward``): 1.0 per correct final answer.

    ``timeout_s`` bounds each completion's check (``functools.partial`` to change it).
    """
    references = reference_answers(len(completions), kwargs)
    out = [0.0] * len(completions)

    async def one(i: int) -> None:
        out[i] = await check_answer(
            completion_text(completions[i]), references[i], timeout_s=timeout_s
        )

    async with anyio.create_task_group() as tg:
        for i in range(len(completions)):
            tg.start_soon(one, i)
    return out
