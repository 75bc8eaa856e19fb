"""The one format of a run directory's metrics files, as the training and the evaluation
writers and readers use it: NaN as null, whole lines, a torn line skipped, the last row wins."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from asyncgrpo.evaluation.records import EVAL_FILE, EVAL_METRICS_FILE, read_evals, write_report
from asyncgrpo.evaluation.runner import EvalReport
from asyncgrpo.run.metrics import MetricsWriter, read_metrics
from asyncgrpo.store.metrics_file import append_rows, read_rows, row_lines


def test_nan_is_written_as_null_and_read_back_as_nan(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    append_rows(path, [{"step": 1, "loss": math.nan, "n": np.float32(2.5), "d": {"x": math.inf}}])
    assert json.loads(path.read_text()) == {"step": 1, "loss": None, "n": 2.5, "d": {"x": None}}
    (row,) = read_rows(path, "step")
    assert math.isnan(row["loss"]) and row["n"] == 2.5


def test_a_torn_line_is_skipped_and_the_last_row_of_a_key_wins(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text(row_lines([{"step": 2, "v": 1}, {"step": 1, "v": 1}]) + '{"step": 3, "v')
    path.write_text(path.read_text() + "\n" + row_lines([{"step": 2, "v": 2}]) + '{"step": 4')
    rows = read_rows(path, "step")
    assert [(r["step"], r["v"]) for r in rows] == [(1, 1), (2, 2)]
    assert "line 3" in caplog.text and "torn last line" in caplog.text


def test_training_and_evaluation_files_share_the_format(tmp_path: Path) -> None:
    with MetricsWriter(tmp_path) as writer:
        writer.log({"reward": math.nan}, step=1)
        writer.log({"reward": 0.5}, step=2)
    report = EvalReport(
        version=3,
        model="m-v3",
        metrics={"eval/version": 3, "eval/reward": math.nan},
        rows=[{"prompt": "p", "reward": math.nan}],
    )
    write_report(tmp_path, report, step=2)
    write_report(
        tmp_path, EvalReport(3, "m-v3", {"eval/version": 3, "eval/reward": 0.25}, []), step=4
    )
    with (tmp_path / EVAL_METRICS_FILE).open("a") as f:
        f.write('{"eval/version": 5, "eval/rew')  # torn by a crash
    assert [r["reward"] for r in read_metrics(tmp_path)][1] == 0.5
    assert math.isnan(read_metrics(tmp_path)[0]["reward"])
    (evaluation,) = read_evals(tmp_path)  # version 3, evaluated twice: the last wins
    assert evaluation["eval/reward"] == 0.25 and evaluation["step"] == 4
    assert json.loads((tmp_path / EVAL_FILE).read_text())["reward"] is None
