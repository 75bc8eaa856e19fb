"""The served-policy audit's logic: which served samples to recompute, how their logprobs
compare with vLLM's, and the verdict; plain Python, no torch.

A replica that loads other weights under a version's name (a stale file, the base model, a
stale prefix cache after a reload) serves logprobs the trainer would not compute at that
version, while every health check passes. So after a sync the trainer recomputes a few
just-trained samples at the version that sampled them and compares them token by token. The
samples are taken round-robin over the replicas that served them (``Sample.replica``), newest
first, starting at a replica that moves on with each audit: a fleet larger than one audit's
sample is covered over a few syncs. The I/O (weights, the forward, metrics, the stop) is the
run's: :mod:`asyncgrpo.run.audit`.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from asyncgrpo.sample import Sample

__all__ = ["AuditTally", "RecentSamples", "by_version", "replica_key", "spread"]

#: How samples without a replica (no proxy in front) are named in metrics and messages.
UNNAMED = "unnamed"


def replica_key(name: str | None) -> str:
    """A replica's name as one metric key segment: the proxy's URL without its scheme, any
    other ``/`` as ``_`` (``http://127.0.0.1:8001`` -> ``127.0.0.1:8001``)."""
    if not name:
        return UNNAMED
    for scheme in ("http://", "https://"):
        name = name.removeprefix(scheme)
    return name.strip("/").replace("/", "_") or UNNAMED


def spread(groups: Sequence[Sequence[Sample]], k: int, *, start: int = 0) -> list[Sample]:
    """Up to ``k`` samples taken round-robin over ``groups`` (one per replica, each newest
    first), beginning with group ``start`` (mod their number)."""
    if not groups:
        return []
    n = len(groups)
    order = [groups[(start + i) % n] for i in range(n)]
    out: list[Sample] = []
    depth = 0
    while len(out) < k and any(depth < len(g) for g in order):
        out += [g[depth] for g in order if depth < len(g)][: k - len(out)]
        depth += 1
    return out


class RecentSamples:
    """The newest trained samples of each replica since the last audit (``per_replica`` of
    each at most: memory stays bounded between audits however rare they are)."""

    def __init__(self, per_replica: int) -> None:
        self.per_replica = per_replica
        self._by_replica: dict[str, deque[Sample]] = {}
        self._audits = 0

    def add(self, samples: Iterable[Sample]) -> None:
        for s in samples:
            if s.num_policy_tokens:
                key = s.replica or UNNAMED
                queue = self._by_replica.setdefault(key, deque(maxlen=self.per_replica))
                queue.append(s)

    def take(self, k: int) -> list[Sample]:
        """``k`` samples spread over the replicas (see :func:`spread`); forgets the rest."""
        names = sorted(self._by_replica)
        groups = [list(reversed(self._by_replica[n])) for n in names]
        picked = spread(groups, k, start=self._audits)
        self._by_replica.clear()
        self._audits += bool(picked)
        return picked


def by_version(samples: Iterable[Sample]) -> dict[int, list[Sample]]:
    """The samples to recompute at each version: a multi-turn sample whose turns ran under
    several versions appears under each (only that version's tokens are compared there)."""
    out: dict[int, list[Sample]] = {}
    for s in samples:
        mask = s.policy_mask()
        for v in sorted({v for v, m in zip(s.token_versions(), mask, strict=True) if m}):
            out.setdefault(v, []).append(s)
    return dict(sorted(out.items()))


@dataclass
class _Gap:
    """|trainer - vLLM| over the tokens of one (replica, version)."""

    max_diff: float = 0.0
    sum_diff: float = 0.0
    tokens: int = 0

    @property
    def mean(self) -> float:
        return self.sum_diff / self.tokens if self.tokens else 0.0

    def merge(self, other: _Gap) -> None:
        self.max_diff = max(self.max_diff, other.max_diff)
        self.sum_diff += other.sum_diff
        self.tokens += other.tokens


@dataclass
class AuditTally:
    """|trainer - vLLM| logprob per policy token, gathered per (replica, version).

    The verdict is on each (replica, version)'s **mean** over its tokens: the largest single
    token's gap grows with the number of tokens audited and, in bfloat16, has a long tail
    (docs/trainer.md), while weights other than the version's move every token. The max is
    reported beside it.
    """

    gaps: dict[tuple[str, int], _Gap] = field(default_factory=dict)

    def add(self, sample: Sample, version: int, recomputed: Sequence[float]) -> None:
        """Compare ``sample``'s tokens of ``version`` with ``recomputed`` (the trainer's
        logprobs of the whole completion at that version, aligned with ``completion_ids``)."""
        if len(recomputed) != len(sample.completion_ids):
            raise ValueError(
                f"sample {sample.group_id}: {len(recomputed)} recomputed logprobs for "
                f"{len(sample.completion_ids)} completion tokens"
            )
        gap = self.gaps.setdefault((sample.replica or UNNAMED, version), _Gap())
        versions, mask = sample.token_versions(), sample.policy_mask()
        for i, (v, m) in enumerate(zip(versions, mask, strict=True)):
            if m and v == version:
                d = abs(recomputed[i] - sample.logprobs[i])
                if d != d:  # NaN: nothing it is compared with can pass
                    d = math.inf
                gap.sum_diff += d
                gap.tokens += 1
                gap.max_diff = max(gap.max_diff, d)

    def per_replica(self) -> dict[str, _Gap]:
        out: dict[str, _Gap] = {}
        for (name, _), gap in sorted(self.gaps.items()):
            if gap.tokens:
                out.setdefault(name, _Gap()).merge(gap)
        return out

    def metrics(self) -> dict[str, float]:
        """``audit/*`` overall and ``audit/replica/<replica>/*`` for each replica audited."""
        replicas = self.per_replica()
        if not replicas:
            return {}
        total = _Gap()
        for gap in replicas.values():
            total.merge(gap)
        out = {
            "audit/max_abs_logprob_diff": total.max_diff,
            "audit/mean_abs_logprob_diff": total.mean,
            "audit/tokens": float(total.tokens),
            "audit/replicas": float(len(replicas)),
        }
        for name, gap in replicas.items():
            key = f"audit/replica/{replica_key(name)}"
            out[f"{key}/max_abs_logprob_diff"] = gap.max_diff
            out[f"{key}/mean_abs_logprob_diff"] = gap.mean
            out[f"{key}/tokens"] = float(gap.tokens)
        return out

    def verdict(self, tolerance: float, *, prefix: str = "", dtype: str = "") -> str | None:
        """One line naming the (replica, version) whose mean gap is largest above
        ``tolerance``, with the difference (and how many other replicas failed); None if all
        pass."""
        failed = sorted(
            ((g.mean, key) for key, g in self.gaps.items() if g.tokens and not g.mean <= tolerance),
            reverse=True,
        )
        if not failed:
            return None
        mean, (name, version) = failed[0]
        g = self.gaps[(name, version)]
        adapter = f"{prefix}-v{version}" if prefix else f"v{version}"
        others = len({n for _, (n, _) in failed} - {name})
        more = f"; {others} other replica(s) too" if others else ""
        precision = f" for {dtype}" if dtype else ""
        theirs = f"{dtype} " if dtype else ""
        return (
            f"served-policy audit: replica {name} serves other weights than version {version} "
            f"({adapter}): its logprobs differ from the trainer's by {mean:.3g} on average over "
            f"{g.tokens} tokens (at most {g.max_diff:.3g}; tolerance {tolerance:g}{precision})"
            f"{more}. Compared: the logprobs it returned with {g.tokens} sampled tokens against "
            f"the trainer's {theirs}logprobs of the same tokens, recomputed from the adapter "
            f"saved when version {version} was published; a replica serving another dtype or "
            "model than the trainer differs this way too (its GET /server_info model_config "
            "against trainer.dtype and model)"
        )
