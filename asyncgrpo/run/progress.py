"""The trainer job's progress lines: written by the job, parsed from its log by the launcher.

A job's only channel back to the launcher is its log, so each optimizer step prints one line
``asyncgrpo-progress {json}``; everything else in the log is left alone.
"""

from __future__ import annotations

import json
import math
from typing import Any

PREFIX = "asyncgrpo-progress "

#: (field in the line, metric of the trainer)
_FIELDS = (
    ("reward", "reward"),
    ("ratio", "ratio"),
    ("sync_s", "perf/weight_sync_s"),
    ("step_s", "perf/step_s"),
    ("staleness", "sample/staleness_mean"),
    ("replicas", "fleet/in_rotation"),
)


def progress_line(step: int, max_steps: int, metrics: dict[str, float]) -> str:
    """One step's line; metrics the step did not produce (no sync this step) are left out."""
    record: dict[str, Any] = {"step": step, "max_steps": max_steps}
    for name, key in _FIELDS:
        value = metrics.get(key)
        if isinstance(value, int | float) and math.isfinite(value):
            record[name] = float(value)
    return PREFIX + json.dumps(record)


def parse_progress(line: str) -> dict[str, Any] | None:
    """The record of a progress line (anywhere in ``line``, after a log prefix); else None."""
    start = line.find(PREFIX)
    if start < 0:
        return None
    try:
        record = json.loads(line[start + len(PREFIX) :])
    except ValueError:
        return None
    if not isinstance(record, dict) or not isinstance(record.get("step"), int):
        return None
    return record


def describe_progress(record: dict[str, Any]) -> str:
    """``step 3/40  reward 0.125  ratio 1.0000  sync 0.41 s  replicas 2`` (fields the step
    lacks omitted), after the run's name for a sweep's (``lr-1: step 3/40 ...``)."""
    parts = [f"step {record['step']}/{record.get('max_steps', '?')}"]
    if "run" in record:
        parts[0] = f"{record['run']}: {parts[0]}"
    if "reward" in record:
        parts.append(f"reward {record['reward']:.3f}")
    if "ratio" in record:
        parts.append(f"ratio {record['ratio']:.4f}")
    if "sync_s" in record:
        parts.append(f"sync {record['sync_s']:.2f} s")
    if "step_s" in record:
        parts.append(f"step {record['step_s']:.2f} s")
    if "replicas" in record:
        parts.append(f"replicas {record['replicas']:.0f}")
    return "  ".join(parts)
