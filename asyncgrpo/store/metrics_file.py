"""The metrics files of a run directory, in one format: JSON lines.

- ``metrics.jsonl``: one row per optimizer step (:mod:`asyncgrpo.run.metrics`);
- ``eval_metrics.jsonl``: one row per evaluation, keyed by the version evaluated, and
  ``eval.jsonl``: one row per evaluated completion (:mod:`asyncgrpo.evaluation.records`).

The rules hold for all three. JSON has no NaN, so a non-finite number is written as ``null`` and
read back as NaN. A write appends its lines whole or not at all: a write that fails partway (a
full disk) is cut back off, so no torn line sits between two whole ones. A reader skips a line
that does not parse (the torn last line of a crash), with a warning, and where a row's key (the
step, the version) appears twice (a resumed run replayed it), the last row wins.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = [
    "EVAL_FILE",
    "EVAL_METRICS_FILE",
    "METRICS_FILE",
    "append_rows",
    "append_whole",
    "parse_row",
    "read_rows",
    "row_lines",
]

logger = logging.getLogger(__name__)

#: One row per optimizer step.
METRICS_FILE = "metrics.jsonl"
#: One row per evaluated completion.
EVAL_FILE = "eval.jsonl"
#: One row per evaluation: the ``eval/*`` metrics of one version.
EVAL_METRICS_FILE = "eval_metrics.jsonl"


def to_json(value: Any) -> Any:
    """``value`` as JSON can hold it: a non-finite float as None, a numpy or torch scalar as a
    Python number, a dict's values likewise."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: to_json(v) for k, v in value.items()}
    if hasattr(value, "item"):  # numpy / torch scalars
        return to_json(value.item())
    return value


def row_lines(rows: Iterable[dict[str, Any]]) -> str:
    """``rows`` as JSON lines, each ending with a newline."""
    return "".join(json.dumps(to_json(row)) + "\n" for row in rows)


def append_whole(path: Path, text: str) -> None:
    """Append ``text`` to ``path`` whole or not at all: a write that fails partway (a full disk)
    is cut back off, so no torn line sits between two whole ones. Raises the ``OSError``."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        size = 0
    try:
        with path.open("a", encoding="utf-8") as f:
            f.write(text)
    except OSError:
        with contextlib.suppress(OSError):
            os.truncate(path, size)
        raise


def append_rows(path: Path, rows: Iterable[dict[str, Any]]) -> None:
    """Append ``rows`` to ``path`` (:func:`append_whole`)."""
    append_whole(path, row_lines(rows))


def parse_row(line: str) -> dict[str, Any] | None:
    """One line's row, ``null`` as NaN; None for a line that is no JSON object (torn, blank)."""
    try:
        row = json.loads(line)
    except ValueError:
        return None
    if not isinstance(row, dict):
        return None
    return {k: (math.nan if v is None else v) for k, v in row.items()}


def read_rows(path: Path, key: str, missing: Any = 0) -> list[dict[str, Any]]:
    """The rows of ``path`` ordered by ``key`` (``missing`` for a row without it), the last row
    of each key; a line that does not parse is skipped with a warning."""
    by_key: dict[Any, dict[str, Any]] = {}
    lines = path.read_text(encoding="utf-8").splitlines()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        row = parse_row(line)
        if row is None:
            where = "its torn last line" if n == len(lines) else f"line {n}, which does not parse"
            logger.warning("%s: skipping %s", path, where)
            continue
        by_key[row.get(key, missing)] = row
    return [by_key[k] for k in sorted(by_key)]
