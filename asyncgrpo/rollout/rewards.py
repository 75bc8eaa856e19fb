"""Reward functions: loaded from import paths, called once per group, never fatal.

Call convention (TRL's, batched per group of G completions of one prompt)::

    def fn(prompts, completions, **kwargs) -> list[float | None]

``prompts`` holds the group's prompt G times (a string, or a list of chat messages);
``completions`` the G completion texts (for a chat prompt, TRL's form
``[{"role": "assistant", "content": text}]``). ``kwargs`` carry ``completion_ids`` and
``prompt_ids`` (token ids) and every extra column of the dataset row, repeated G times, so TRL
reward functions work unchanged. ``async def`` functions are awaited concurrently; plain ones
run in worker threads (a shared limiter), so a slow one never blocks the event loop.

An exception, a ``None``, a non-number or a result of the wrong length becomes NaN for that
completion, is counted, and the run goes on. The combined reward is the weighted sum over
functions that gave a number (TRL's ``nansum``: ``None`` lets a function abstain); it is NaN
only when every function failed for that completion.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio

from asyncgrpo.errors import ConfigError

logger = logging.getLogger(__name__)

RewardFunc = Callable[..., Any]


def load_reward_func(path: str) -> RewardFunc:
    """Import ``'package.module:function'`` (dots after the colon walk attributes)."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"reward function {path!r}: write it as 'package.module:function'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"reward function {path!r}: cannot import module {module_name!r} ({exc}); "
            "check the path and that the module is installed or on PYTHONPATH"
        ) from exc
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise ConfigError(
                f"reward function {path!r}: module {module_name!r} has no attribute {attr!r}"
            ) from exc
    if not callable(obj):
        raise ConfigError(f"reward function {path!r} is not callable")
    return obj


def reward_func_name(func: RewardFunc) -> str:
    """The metric name of a function: ``rewards/<name>``."""
    inner = func.func if isinstance(func, functools.partial) else func
    return getattr(inner, "__name__", type(inner).__name__)


def _is_async(func: RewardFunc) -> bool:
    inner = func.func if isinstance(func, functools.partial) else func
    return inspect.iscoroutinefunction(inner) or inspect.iscoroutinefunction(
        getattr(inner, "__call__", None)  # noqa: B004 - async callable objects
    )


@dataclass(slots=True)
class GroupScores:
    """Rewards of one group: combined and per function (NaN where a function failed)."""

    rewards: list[float]
    per_func: dict[str, list[float]]
    nan_count: int = 0
    error_count: int = 0


@dataclass
class RewardScorer:
    """Scores groups with several reward functions, concurrently, and counts failures.

    ``funcs`` may be callables or import paths. Names (the ``rewards/<name>`` metric keys) are
    made unique by suffixing ``_2``, ``_3`` when two functions share a name.
    """

    funcs: Sequence[RewardFunc | str]
    weights: Sequence[float] | None = None
    max_threads: int = 4
    names: list[str] = field(init=False)
    nan_total: int = field(init=False, default=0)
    error_total: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self._funcs = [load_reward_func(f) if isinstance(f, str) else f for f in self.funcs]
        if not self._funcs:
            raise ConfigError("no reward functions: set rollout.reward_funcs to at least one")
        if self.weights is None:
            self.weights = [1.0] * len(self._funcs)
        if len(self.weights) != len(self._funcs):
            raise ConfigError(
                f"{len(self.weights)} reward weights for {len(self._funcs)} reward functions"
            )
        self.names = []
        for func in self._funcs:
            name = base = reward_func_name(func)
            k = 1
            while name in self.names:
                k += 1
                name = f"{base}_{k}"
            self.names.append(name)
        self._limiter = anyio.CapacityLimiter(self.max_threads)

    async def score(
        self,
        prompts: Sequence[Any],
        completions: Sequence[Any],
        **kwargs: Any,
    ) -> GroupScores:
        """Run every function on one group; a failure only turns its rewards into NaN."""
        n = len(completions)
        results: list[list[float]] = [[math.nan] * n for _ in self._funcs]
        errors = 0

        async def run_one(i: int) -> None:
            nonlocal errors
            func, name = self._funcs[i], self.names[i]
            try:
                if _is_async(func):
                    out = await func(list(prompts), list(completions), **kwargs)
                else:
                    call = functools.partial(func, list(prompts), list(completions), **kwargs)
                    out = await anyio.to_thread.run_sync(
                        call, limiter=self._limiter, abandon_on_cancel=True
                    )
                    if inspect.isawaitable(out):
                        out = await out
            except Exception:
                errors += 1
                logger.warning(
                    "reward function %s raised; its rewards are NaN", name, exc_info=True
                )
                return
            results[i] = self._coerce(name, out, n)

        async with anyio.create_task_group() as tg:
            for i in range(len(self._funcs)):
                tg.start_soon(run_one, i)

        combined: list[float] = []
        for j in range(n):
            vals = [(w, results[i][j]) for i, w in enumerate(self.weights or [])]
            finite = [w * v for w, v in vals if not math.isnan(v)]
            combined.append(math.fsum(finite) if finite else math.nan)
        nan_count = sum(math.isnan(r[j]) for r in results for j in range(n))
        self.nan_total += nan_count
        self.error_total += errors
        return GroupScores(
            rewards=combined,
            per_func=dict(zip(self.names, results, strict=True)),
            nan_count=nan_count,
            error_count=errors,
        )

    @staticmethod
    def _coerce(name: str, out: Any, n: int) -> list[float]:
        """Turn a function's result into n floats; anything unusable becomes NaN."""
        try:
            values = list(out)
        except TypeError:
            logger.warning("reward function %s returned %r, not a list; NaN", name, type(out))
            return [math.nan] * n
        if len(values) != n:
            logger.warning(
                "reward function %s returned %d rewards for %d completions; NaN",
                name,
                len(values),
                n,
            )
            return [math.nan] * n
        coerced = []
        for v in values:
            try:
                coerced.append(math.nan if v is None else float(v))
            except (TypeError, ValueError):
                coerced.append(math.nan)
        return coerced
