"""Where evaluations are kept in a run directory.

- ``eval.jsonl``: one line per completion (version, prompt, completion, reward, its parts), to
  read what the model answered;
- ``eval_metrics.jsonl``: one line per evaluation, the ``eval/*`` metrics keyed by the version
  evaluated (``eval/version``) and the trainer's step when it ran.

Both are appended to, so a resumed run keeps the evaluations of its earlier part; their format
(``null`` for NaN, whole lines, the last row of a version wins) is
:mod:`asyncgrpo.store.metrics_file`'s, shared with ``metrics.jsonl``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncgrpo.store.metrics_file import EVAL_FILE, EVAL_METRICS_FILE, append_rows, read_rows

if TYPE_CHECKING:
    from asyncgrpo.evaluation.runner import EvalReport

__all__ = ["EVAL_FILE", "EVAL_METRICS_FILE", "read_evals", "write_report"]


def write_report(run_dir: str | Path, report: EvalReport, *, step: int) -> None:
    """Append ``report`` to the run directory's two files (blocking: call from a thread), each
    whole or not at all (:mod:`asyncgrpo.store.metrics_file`)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    append_rows(run_dir / EVAL_FILE, report.rows)
    append_rows(
        run_dir / EVAL_METRICS_FILE, [{"step": step, "model": report.model, **report.metrics}]
    )


def read_evals(run_dir: str | Path) -> list[dict[str, Any]]:
    """The evaluations of a run, by version (the last of a version evaluated twice wins);
    ``[]`` when it has none."""
    path = Path(run_dir) / EVAL_METRICS_FILE
    return read_rows(path, "eval/version", missing=-1) if path.is_file() else []
