"""Where evaluations are kept in a run directory.

- ``eval.jsonl``: one line per completion (version, prompt, completion, reward, its parts), to
  read what the model answered;
- ``eval_metrics.jsonl``: one line per evaluation, the ``eval/*`` metrics keyed by the version
  evaluated (``eval/version``) and the trainer's step when it ran.

Both are appended to, so a resumed run keeps the evaluations of its earlier part.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncgrpo.evaluation.runner import EvalReport

__all__ = ["EVAL_FILE", "EVAL_METRICS_FILE", "read_evals", "write_report"]

EVAL_FILE = "eval.jsonl"
EVAL_METRICS_FILE = "eval_metrics.jsonl"


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    return value


def write_report(run_dir: str | Path, report: EvalReport, *, step: int) -> None:
    """Append ``report`` to the run directory's two files (blocking: call from a thread)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    with (run_dir / EVAL_FILE).open("a", encoding="utf-8") as f:
        for row in report.rows:
            f.write(json.dumps(_clean(row)) + "\n")
    record = {"step": step, "model": report.model, **_clean(report.metrics)}
    with (run_dir / EVAL_METRICS_FILE).open("a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def read_evals(run_dir: str | Path) -> list[dict[str, Any]]:
    """The evaluations of a run, by version (the last of a version evaluated twice wins);
    ``[]`` when it has none."""
    path = Path(run_dir) / EVAL_METRICS_FILE
    if not path.is_file():
        return []
    by_version: dict[float, dict[str, Any]] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a torn last line
        record = {k: (math.nan if v is None else v) for k, v in record.items()}
        by_version[record.get("eval/version", -1)] = record
    return [by_version[v] for v in sorted(by_version)]
