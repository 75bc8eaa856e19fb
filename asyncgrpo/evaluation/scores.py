"""What an evaluation's rewards say: means, pass@1 and the unbiased pass@k. Pure."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

__all__ = ["Graded", "pass_at_k", "summarize"]


@dataclass(frozen=True, slots=True)
class Graded:
    """One prompt's k completions, scored."""

    rewards: Sequence[float]  #: combined reward per completion (NaN: every function failed)
    per_func: Mapping[str, Sequence[float]] = field(default_factory=dict)
    completion_tokens: Sequence[int] = ()


def pass_at_k(n: int, c: int, k: int) -> float:
    """The chance that at least one of ``k`` completions drawn without replacement from ``n``,
    of which ``c`` pass, passes: ``1 - C(n-c, k) / C(n, k)`` (Chen et al. 2021, unbiased)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k(n={n}, c={c}, k={k}): need 0 <= c <= n and 1 <= k <= n")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _mean(values: Sequence[float]) -> float:
    kept = [v for v in values if not math.isnan(v)]
    return statistics.fmean(kept) if kept else math.nan


def summarize(graded: Sequence[Graded], *, k: int, threshold: float) -> dict[str, float]:
    """``eval/*`` metrics of one evaluation; a NaN reward counts as a failed completion."""
    rewards = [r for g in graded for r in g.rewards]
    finite = [r for r in rewards if not math.isnan(r)]
    out = {
        "eval/prompts": float(len(graded)),
        "eval/completions": float(len(rewards)),
        "eval/reward": _mean(rewards),
        "eval/reward_std": statistics.pstdev(finite) if len(finite) > 1 else 0.0,
        "eval/completion_tokens": _mean([float(t) for g in graded for t in g.completion_tokens]),
    }
    scored = [g for g in graded if g.rewards]
    if scored:
        passes = [(len(g.rewards), sum(r >= threshold for r in g.rewards)) for g in scored]
        out["eval/pass@1"] = statistics.fmean(pass_at_k(n, c, 1) for n, c in passes)
        out[f"eval/pass@{k}"] = statistics.fmean(pass_at_k(n, c, min(k, n)) for n, c in passes)
    names = sorted({name for g in graded for name in g.per_func})
    for name in names:
        out[f"eval/rewards/{name}"] = _mean([v for g in graded for v in g.per_func.get(name, ())])
    return out
