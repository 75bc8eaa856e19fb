"""Training metrics: one JSON object per optimizer step in ``metrics.jsonl``, mirrored to the
run's trackers (:mod:`asyncgrpo.run.trackers`).

Names follow TRL's async GRPO where the meaning matches (``perf/step_s``, ``ratio``,
``clip_ratio/low_mean``, ``sample/staleness_mean``...). The file's format (``null`` for NaN, whole
lines, the last row of a step wins) is :mod:`asyncgrpo.store.metrics_file`'s, shared with the
evaluation files. Means skip NaN (a failed reward is NaN and must not turn a whole step's mean
into NaN).
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from asyncgrpo.run.trackers import Tracker, numeric
from asyncgrpo.store.metrics_file import (
    METRICS_FILE,
    append_whole,
    parse_row,
    read_rows,
    row_lines,
)

__all__ = [
    "METRICS_FILE",
    "MetricsBuffer",
    "MetricsWriter",
    "append_whole",
    "nanmean",
    "read_metrics",
    "summarize",
    "trim_metrics",
]

logger = logging.getLogger(__name__)


def nanmean(values: Iterable[float]) -> float:
    """Mean of the non-NaN values (None counts as NaN); NaN if there are none."""
    kept = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    return sum(kept) / len(kept) if kept else math.nan


class MetricsBuffer:
    """Collects values per key between two log calls; ``means()`` averages them skipping NaN."""

    def __init__(self) -> None:
        self._values: dict[str, list[float]] = defaultdict(list)

    def add(self, key: str, value: float) -> None:
        self._values[key].append(float(value))

    def update(self, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.add(key, value)

    def means(self) -> dict[str, float]:
        return {key: nanmean(values) for key, values in self._values.items()}

    def clear(self) -> None:
        self._values.clear()


class MetricsWriter:
    """Appends one line per step to ``run_dir/metrics.jsonl`` and mirrors it to ``trackers``.

    Appending (not truncating) lets a resumed run continue the same file. ``after_step``: the
    step the run resumes from (0: a fresh start); the lines of later steps, which it trains
    again, are dropped first (and a torn last line), so each step appears once in the file;
    ``restore``: that step's line, written when the file lacks it (a run killed between its
    checkpoint and its line).
    A line that cannot be written (a full disk) is kept and written with the next one: late,
    never torn or missing.
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        jsonl: bool = True,
        trackers: Sequence[Tracker] = (),
        after_step: int | None = None,
        restore: dict[str, Any] | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / METRICS_FILE
        self._jsonl = jsonl
        self._unwritten: list[str] = []
        last = None
        if jsonl:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            if after_step is not None:
                last = trim_metrics(self.path, after_step)
            self.path.touch()
        self._trackers = list(trackers)
        self._last_step = -1  #: the last step sent to the trackers
        if restore is not None and after_step and last != after_step:
            self.log(restore, step=after_step)

    def log(self, metrics: dict[str, Any], *, step: int) -> None:
        self._last_step = max(self._last_step, step)
        record = {"step": step, "time": time.time(), **metrics}
        if self._jsonl:
            self._unwritten.append(row_lines([record]))
            self._write()
        if self._trackers:
            values = numeric(record)
            for tracker in self._trackers:
                tracker.log(values, step=step)

    def mirror(self, metrics: dict[str, Any], *, step: int) -> None:
        """Send ``metrics`` to the trackers only (an evaluation keeps its own file), at ``step``
        or the last step logged if that is later: an evaluation during training ends steps
        after the version it measures, and W&B drops a record whose step goes back (its
        ``eval/*`` are plotted against ``eval/version``)."""
        step = max(step, self._last_step)
        self._last_step = step
        values = numeric(metrics)
        for tracker in self._trackers:
            tracker.log(values, step=step)

    def _write(self) -> None:
        try:
            append_whole(self.path, "".join(self._unwritten))
        except OSError as exc:
            logger.warning(
                "%s: %d lines kept for the next write: %s", self.path, len(self._unwritten), exc
            )
            return
        self._unwritten.clear()

    def close(self) -> None:
        if self._unwritten:
            self._write()
        trackers, self._trackers = self._trackers, []
        for tracker in trackers:
            tracker.finish()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def trim_metrics(path: Path, after_step: int) -> int | None:
    """Drop the lines of ``path`` for steps after ``after_step`` (and lines that do not parse:
    a torn last line); the file is replaced whole. Returns the last step kept (None: none)."""
    if not path.is_file():
        return None
    kept: list[str] = []
    last = None
    lines = path.read_text(encoding="utf-8").splitlines()
    for line in lines:
        step = (parse_row(line) or {}).get("step")
        if isinstance(step, int) and step <= after_step:
            kept.append(line)
            last = step if last is None else max(last, step)
    dropped = len(lines) - len(kept)
    if dropped:
        tmp = path.with_name(f".{path.name}.trim")
        tmp.write_text("".join(f"{line}\n" for line in kept), encoding="utf-8")
        tmp.replace(path)
        logger.info("%s: dropped %d lines after step %d (trained again)", path, dropped, after_step)
    return last


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Records of a ``metrics.jsonl`` (or of the run directory holding one), ordered by step.

    ``null`` becomes NaN; when a step appears more than once (a resumed run replayed it), the
    last record wins. A line that does not parse (a crash's torn last line) is skipped.
    """
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    return read_rows(path, "step")


def summarize(records: Sequence[dict[str, Any]], key: str, first: int = 5) -> tuple[float, float]:
    """Mean of ``key`` over the first and the last ``first`` steps (NaN-skipping)."""
    values = [
        r[key] for r in records if isinstance(r.get(key), int | float) and not math.isnan(r[key])
    ]
    if not values:
        return math.nan, math.nan
    n = min(first, len(values))
    return statistics.fmean(values[:n]), statistics.fmean(values[-n:])
