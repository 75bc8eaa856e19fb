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
class _ReplicaGap:
    max_diff: float = 0.0
    sum_diff: float = 0.0
    tokens: int = 0
    version: int = -1  #: the version of its largest difference


@dataclass
class AuditTally:
    """|trainer - vLLM| logprob per policy token, gathered per replica."""

    per_replica: dict[str, _ReplicaGap] = field(default_factory=dict)

    def add(self, sample: Sample, version: int, recomputed: Sequence[float]) -> None:
        """Compare ``sample``'s tokens of ``version`` with ``recomputed`` (the trainer's
        logprobs of the whole completion at that version, aligned with ``completion_ids``)."""
        if len(recomputed) != len(sample.completion_ids):
            raise ValueError(
                f"sample {sample.group_id}: {len(recomputed)} recomputed logprobs for "
                f"{len(sample.completion_ids)} completion tokens"
            )
        gap = self.per_replica.setdefault(sample.replica or UNNAMED, _ReplicaGap())
        versions, mask = sample.token_versions(), sample.policy_mask()
        for i, (v, m) in enumerate(zip(versions, mask, strict=True)):
            if m and v == version:
                d = abs(recomputed[i] - sample.logprobs[i])
                if d != d:  # NaN: nothing it is compared with can pass
                    d = float("inf")
                gap.sum_diff += d
                gap.tokens += 1
                if gap.version < 0 or d > gap.max_diff:
                    gap.max_diff, gap.version = d, version

    @property
    def tokens(self) -> int:
        return sum(g.tokens for g in self.per_replica.values())

    def metrics(self) -> dict[str, float]:
        """``audit/*`` overall and ``audit/replica/<replica>/*`` for each replica audited."""
        gaps = [g for g in self.per_replica.values() if g.tokens]
        if not gaps:
            return {}
        tokens = sum(g.tokens for g in gaps)
        out = {
            "audit/max_abs_logprob_diff": max(g.max_diff for g in gaps),
            "audit/mean_abs_logprob_diff": sum(g.sum_diff for g in gaps) / tokens,
            "audit/tokens": float(tokens),
            "audit/replicas": float(len(gaps)),
        }
        for name, g in sorted(self.per_replica.items()):
            if g.tokens:
                key = f"audit/replica/{replica_key(name)}"
                out[f"{key}/max_abs_logprob_diff"] = g.max_diff
                out[f"{key}/mean_abs_logprob_diff"] = g.sum_diff / g.tokens
                out[f"{key}/tokens"] = float(g.tokens)
        return out

    def verdict(self, tolerance: float, *, prefix: str = "", dtype: str = "") -> str | None:
        """One line naming the replica with the largest difference above ``tolerance``, the
        version and the difference (and how many other replicas failed); None if all pass."""
        failed = sorted(
            ((g.max_diff, name) for name, g in self.per_replica.items()
             if g.tokens and not g.max_diff <= tolerance),
            reverse=True,
        )  # fmt: skip
        if not failed:
            return None
        diff, name = failed[0]
        g = self.per_replica[name]
        adapter = f"{prefix}-v{g.version}" if prefix else f"v{g.version}"
        others = f"; {len(failed) - 1} other replica(s) too" if len(failed) > 1 else ""
        precision = f" for {dtype}" if dtype else ""
        return (
            f"served-policy audit: replica {name} serves other weights than version {g.version} "
            f"({adapter}): its logprobs differ from the trainer's by up to {diff:.3g} (mean "
            f"{g.sum_diff / g.tokens:.3g} over {g.tokens} tokens; tolerance {tolerance:g}"
            f"{precision}){others}"
        )
