"""Progress lines: what the trainer job prints, what the launcher reads back."""

from __future__ import annotations

import math

from asyncgrpo.run.progress import describe_progress, parse_progress, progress_line


def test_round_trip_through_a_log_line() -> None:
    metrics = {"reward": 0.25, "ratio": 1.0001, "perf/weight_sync_s": 0.4, "loss": 3.0,
               "perf/step_s": math.nan}  # fmt: skip
    line = "2026-11-30 10:00:00 INFO x: " + progress_line(7, 40, metrics)
    record = parse_progress(line)
    assert record == {"step": 7, "max_steps": 40, "reward": 0.25, "ratio": 1.0001, "sync_s": 0.4}
    assert describe_progress(record) == "step 7/40  reward 0.250  ratio 1.0001  sync 0.40 s"
    # with a fleet that lost a member: the replicas in rotation
    record = parse_progress(progress_line(8, 40, {**metrics, "fleet/in_rotation": 1.0}))
    assert describe_progress(record).endswith("sync 0.40 s  replicas 1")  # type: ignore[arg-type]
    # a sweep's: the launcher adds the run's name
    assert describe_progress({"step": 3, "max_steps": 40, "run": "lr-1"}) == "lr-1: step 3/40"


def test_other_lines_are_not_progress() -> None:
    for line in [
        "",
        "INFO loading model",
        "asyncgrpo-progress {broken",
        'asyncgrpo-progress {"a": 1}',
    ]:
        assert parse_progress(line) is None
