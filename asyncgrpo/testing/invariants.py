"""What must hold after a run under faults, checked on the run's own records: pure functions, no
I/O (the bench reads the records: ``bench/chaos.py``; the unit tests feed them by hand).

Like a Jepsen checker, each takes a history (the ledgers of :mod:`asyncgrpo.run.ledger`, the
batches and adapter manifests found in the store, the metrics rows, the fault windows) and
returns what it found; a :class:`Violation` names the invariant and the evidence.

- :func:`check_samples`: every sample trained at most once across the trainer's lives (its
  rolled-back steps aside), only shipped samples trained, and none that a rollout process
  shipped and the channel acknowledged lost: each is trained, dropped as stale, quarantined, or
  still unread when the run ended.
- :func:`check_versions`: every published version present in the store and verifying, with the
  files its publisher recorded; no version number published twice; no hole in the numbers.
- :func:`check_metrics`: one ``metrics.jsonl`` row per step, no gap, no duplicate.
- :func:`check_audits`: every served-policy audit passes outside fault windows; one that fails
  inside a window is explained by that fault and names the replica.
- :func:`check_band`: a result of the run within the band of clean runs.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from asyncgrpo.run.ledger import lineage

__all__ = [
    "AuditReport",
    "FaultWindow",
    "SampleReport",
    "Violation",
    "check_audits",
    "check_band",
    "check_metrics",
    "check_samples",
    "check_versions",
]


@dataclass(frozen=True)
class Violation:
    """An invariant that does not hold, and the evidence."""

    invariant: str
    detail: str

    def __str__(self) -> str:
        return f"{self.invariant}: {self.detail}"


@dataclass
class SampleReport:
    """Where every shipped sample went, and what does not add up."""

    shipped: int = 0
    trained: int = 0
    dropped_stale: int = 0
    quarantined: int = 0
    left_over: int = 0  #: in the last batch the final trainer read, not needed by its last step
    unread: int = 0  #: in batches shipped after the last one the final trainer read
    rolled_back_steps: int = 0  #: steps trained by a life that died, then trained again
    violations: list[Violation] = field(default_factory=list)


def _sample_id(entry: Any) -> Any:
    """A ``dropped_stale`` entry is ``[id, version]``; a ``trained`` entry is the id."""
    return entry[0] if isinstance(entry, list) else entry


def check_samples(
    batches: Mapping[int, Sequence[str | None]],
    shipped: Iterable[Mapping[str, Any]],
    trained: Iterable[Mapping[str, Any]],
    *,
    quarantined: Collection[int] = (),
) -> SampleReport:
    """``batches``: the sample ids of every batch the channel holds, by sequence number;
    ``shipped``: the rollout processes' ledger lines (appends the channel acknowledged);
    ``trained``: the trainer's ledger lines (all lives, in the order written);
    ``quarantined``: batch numbers the channel moved aside as malformed."""
    report = SampleReport()
    quarantined = set(quarantined)
    where = _batch_of(batches, report)
    _acknowledged(batches, shipped, quarantined, report.violations)
    kept, rolled_back = lineage(trained)
    report.rolled_back_steps = len(rolled_back)
    taken = _taken(kept, where, report)
    last = max((where[i] for i in taken if i in where), default=-1)
    for seq, ids in sorted(batches.items()):
        if seq in quarantined:
            report.quarantined += len(ids)
            continue
        missing = [i for i in ids if i is not None and i not in taken]
        if seq > last:
            report.unread += len(ids)
        elif seq == last:
            report.left_over += len(missing)
        elif missing:
            shown = ", ".join(missing[:4]) + (f" (+{len(missing) - 4})" if len(missing) > 4 else "")
            report.violations.append(
                Violation(
                    "none lost",
                    f"batch {seq}: {shown} shipped, acknowledged, and neither trained "
                    "nor dropped by the final lineage",
                )
            )
    return report


def _batch_of(batches: Mapping[int, Sequence[str | None]], report: SampleReport) -> dict[str, int]:
    """Sample id -> the batch holding it; counts the shipped samples."""
    where: dict[str, int] = {}
    for seq, ids in sorted(batches.items()):
        report.shipped += len(ids)
        if any(i is None for i in ids):
            report.violations.append(
                Violation("sample ids", f"batch {seq} holds samples without an id")
            )
        for i in ids:
            if i is None:
                continue
            if i in where:
                report.violations.append(
                    Violation("shipped once", f"sample {i} is in batches {where[i]} and {seq}")
                )
            where[i] = seq
    return where


def _acknowledged(
    batches: Mapping[int, Sequence[str | None]],
    shipped: Iterable[Mapping[str, Any]],
    quarantined: set[int],
    violations: list[Violation],
) -> None:
    """Every batch a rollout process was told it shipped is in the store, as shipped."""
    for line in shipped:
        seq, ids, life = line["seq"], list(line["ids"]), line.get("life")
        if seq in quarantined:
            continue
        if seq not in batches:
            violations.append(
                Violation(
                    "none lost",
                    f"batch {seq} was acknowledged to rollout process {life} and is "
                    "not in the store",
                )
            )
        elif list(batches[seq]) != ids:
            violations.append(
                Violation(
                    "none lost",
                    f"batch {seq} in the store is not the one acknowledged to rollout "
                    f"process {life}",
                )
            )


def _taken(
    kept: Sequence[Mapping[str, Any]], where: Mapping[str, int], report: SampleReport
) -> dict[str, int]:
    """Sample id -> the step of the final lineage that took it (trained or dropped); a second
    take, and a sample no batch holds, are violations."""
    v = report.violations
    taken: dict[str, int] = {}
    for line in kept:
        step = line["step"]
        entries = [(i, "trained") for i in line["trained"]]
        entries += [(_sample_id(e), "dropped") for e in line.get("dropped_stale", [])]
        for sample_id, what in entries:
            if sample_id is None:
                v.append(Violation("sample ids", f"step {step} {what} a sample without an id"))
                continue
            if sample_id in taken:
                verb = "trained at most once" if what == "trained" else "taken at most once"
                v.append(
                    Violation(
                        verb,
                        f"sample {sample_id} taken at step {taken[sample_id]} "
                        f"and {what} again at step {step}",
                    )
                )
            taken[sample_id] = step
            if sample_id not in where:
                v.append(
                    Violation(
                        "only shipped samples trained",
                        f"step {step} {what} sample {sample_id}, which no batch holds",
                    )
                )
        report.trained += len(line["trained"])
        report.dropped_stale += len(line.get("dropped_stale", []))
    return taken


def check_versions(
    published: Iterable[Mapping[str, Any]],
    store: Mapping[int, Mapping[str, str]],
    verify_errors: Mapping[int, str],
) -> tuple[list[Violation], list[int]]:
    """``published``: the trainer's ``published`` ledger lines (all lives); ``store``: the files
    (path -> sha256) of every version whose manifest the store holds; ``verify_errors``: the
    versions whose fetch did not verify, with the error. Returns the violations and the
    versions no ledger line claims (a publisher killed after its manifest landed and before
    it wrote the line: not a violation)."""
    violations: list[Violation] = []
    claimed: dict[int, Mapping[str, Any]] = {}
    for line in published:
        version = line["version"]
        if version in claimed:
            violations.append(
                Violation(
                    "no version name reused",
                    f"version {version} published by life {claimed[version].get('life')} and again "
                    f"by life {line.get('life')}",
                )
            )
        claimed[version] = line
        if version not in store:
            violations.append(
                Violation(
                    "every published version in the store",
                    f"version {version} (step {line.get('step')}) is gone",
                )
            )
        elif dict(store[version]) != dict(line["files"]):
            violations.append(
                Violation(
                    "every published version in the store",
                    f"version {version}'s files are not those life {line.get('life')} published",
                )
            )
    for version, error in sorted(verify_errors.items()):
        violations.append(Violation("every version verifies", f"version {version}: {error}"))
    if store and sorted(store) != list(range(max(store) + 1)):
        holes = sorted(set(range(max(store) + 1)) - set(store))
        violations.append(Violation("no hole in the version numbers", f"missing {holes[:10]}"))
    unclaimed = sorted(set(store) - set(claimed))
    return violations, unclaimed


def check_metrics(rows: Sequence[Mapping[str, Any]], max_steps: int) -> list[Violation]:
    """``rows``: ``metrics.jsonl`` as written (file order). One row per step 1..``max_steps``."""
    steps = [row.get("step") for row in rows]
    violations = []
    counts = Counter(steps)
    if dup := sorted(s for s, n in counts.items() if n > 1):
        violations.append(
            Violation(
                "one metrics row per step", f"steps {dup[:10]} appear {max(counts.values())} times"
            )
        )
    if gaps := sorted(set(range(1, max_steps + 1)) - set(counts)):
        violations.append(Violation("no gap in the metrics", f"steps {gaps[:10]} have no row"))
    if extra := sorted(s for s in counts if s not in range(1, max_steps + 1)):
        violations.append(Violation("one metrics row per step", f"rows for steps {extra[:10]}"))
    if steps != sorted(steps):
        violations.append(Violation("one metrics row per step", "rows out of step order"))
    return violations


@dataclass(frozen=True)
class FaultWindow:
    """A fault in force from ``start`` to ``end`` (seconds, the clock of the rows' ``time``)."""

    name: str
    start: float
    end: float

    def covers(self, t: float, grace_s: float) -> bool:
        return self.start - grace_s <= t <= self.end + grace_s


@dataclass
class AuditReport:
    audits: int = 0  #: rows with an audit
    passed: int = 0
    explained: list[str] = field(default_factory=list)  #: failures inside a fault window
    violations: list[Violation] = field(default_factory=list)


_REPLICA_KEY = re.compile(r"audit/replica/(.+)/mean_abs_logprob_diff")


def check_audits(
    rows: Iterable[Mapping[str, Any]],
    windows: Sequence[FaultWindow],
    tolerance: float,
    *,
    grace_s: float = 30.0,
) -> AuditReport:
    """Each row with ``audit/*`` metrics is one audit after a sync; a replica whose mean
    |trainer - vLLM| logprob exceeds ``tolerance`` failed it. A failure at a row's ``time``
    within ``grace_s`` of a fault window is explained by that fault (and named with the
    replica); any other is a violation."""
    report = AuditReport()
    for row in rows:
        failed = []
        for key, value in row.items():
            match = _REPLICA_KEY.fullmatch(key)
            if match and isinstance(value, int | float) and not value <= tolerance:
                failed.append((match.group(1), value))
        if not any(_REPLICA_KEY.fullmatch(k) for k in row):
            continue
        report.audits += 1
        if not failed:
            report.passed += 1
            continue
        t = float(row.get("time", 0.0))
        for replica, value in failed:
            inside = [w.name for w in windows if w.covers(t, grace_s)]
            what = f"step {row.get('step')}: replica {replica} off by {value:.3g}"
            if inside:
                report.explained.append(f"{what} during {', '.join(inside)}")
            else:
                report.violations.append(
                    Violation("the served-policy audit passes outside faults", what)
                )
    return report


def check_band(
    name: str, value: float, clean: Sequence[float], *, margin: float
) -> list[Violation]:
    """``value`` within [min(clean) - margin, max(clean) + margin]."""
    if not clean:
        return [Violation(f"{name} within the clean band", "no clean run to compare with")]
    low, high = min(clean) - margin, max(clean) + margin
    if value != value or not low <= value <= high:
        return [
            Violation(
                f"{name} within the clean band",
                f"{value:.3f} outside [{low:.3f}, {high:.3f}] (clean runs "
                f"{', '.join(f'{c:.3f}' for c in clean)}, margin {margin})",
            )
        ]
    return []
