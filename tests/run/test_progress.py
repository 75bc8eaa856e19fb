"""Progress lines: what the trainer job prints, what the launcher reads back."""

from __future__ import annotations

import io
import math
from pathlib import Path

from asyncgrpo.run.progress import (
    ConsoleProgress,
    JobLines,
    as_progress,
    describe_progress,
    parse_progress,
    progress_line,
    summary_lines,
)
from asyncgrpo.store.run_documents import RunResult


def test_round_trip_through_a_log_line() -> None:
    metrics = {
        "reward": 0.25,
        "ratio": 1.0001,
        "perf/weight_sync_s": 0.4,
        "loss": 3.0,
        "perf/step_s": math.nan,
    }
    line = "2026-11-30 10:00:00 INFO x: " + progress_line(7, 40, metrics)
    record = parse_progress(line)
    assert record == {"step": 7, "max_steps": 40, "reward": 0.25, "ratio": 1.0001, "sync_s": 0.4}
    assert describe_progress(record) == "step 7/40  reward 0.250  ratio 1.0001  sync 0.40 s"
    # with a fleet that lost a member: the replicas in rotation
    record = parse_progress(progress_line(8, 40, {**metrics, "fleet/in_rotation": 1.0}))
    assert describe_progress(record).endswith("sync 0.40 s  replicas 1")  # type: ignore[arg-type]
    # a sweep's: the launcher adds the run's name
    assert describe_progress({"step": 3, "max_steps": 40, "run": "lr-1"}) == "lr-1: step 3/40"


def test_a_step_line_shows_the_last_evaluation() -> None:
    metrics = {"reward": 0.5, "adapter_version": 7.0, "eval/version": 4.0, "eval/reward": 0.375}
    line = progress_line(8, 10, metrics)
    assert describe_progress(parse_progress(line) or {}) == (
        "step 8/10  reward 0.500  v 7  eval v 4  eval reward 0.375"
    )


def test_other_lines_are_not_progress() -> None:
    for line in [
        "",
        "INFO loading model",
        "asyncgrpo-progress {broken",
        'asyncgrpo-progress {"a": 1}',
    ]:
        assert parse_progress(line) is None


def test_a_step_line_shows_reward_staleness_version_and_step_time() -> None:
    metrics = {
        "reward": 0.5,
        "sample/staleness_mean": 0.75,
        "adapter_version": 3.0,
        "perf/step_s": 1.25,
    }
    assert describe_progress(parse_progress(progress_line(4, 10, metrics)) or {}) == (
        "step 4/10  reward 0.500  staleness 0.75  v 3  step 1.25 s"
    )


def test_console_progress_off_a_terminal_prints_phases_and_one_line_per_step() -> None:
    out = io.StringIO()  # not a terminal: no bar
    with ConsoleProgress(3, stream=out) as progress:
        progress.phase("model runs/tiny-model: found")
        for step in (1, 2, 3):
            progress.step(step, {"reward": step / 10})
    lines = out.getvalue().splitlines()
    assert lines[0].endswith("] model runs/tiny-model: found")
    assert lines[1:] == [f"step {s}/3  reward {s / 10:.3f}" for s in (1, 2, 3)]


def test_console_progress_on_a_terminal_draws_a_bar() -> None:
    out = io.StringIO()
    with ConsoleProgress(2, stream=out, bar=True) as progress:
        progress.step(1, {"reward": 0.25})
        progress.phase("a phase while the bar is up")
        progress.step(2, {"reward": 0.5})
    text = out.getvalue()
    assert "training: 100%" in text and "2/2" in text and "reward 0.500" in text
    assert "a phase while the bar is up\n" in text


def test_a_plain_callback_hears_the_steps_only() -> None:
    seen: list[int] = []
    progress = as_progress(lambda step, metrics: seen.append(step))
    progress.phase("ignored")
    progress.step(1, {})
    assert seen == [1]


def _result(tmp_path: Path, steps: int, resumed: int | None) -> RunResult:
    return RunResult(
        run_dir=tmp_path,
        adapter_prefix="tiny-ab12",
        steps=steps,
        final_version=4,
        resumed_from_step=resumed,
        transport_url="file:///s",
    )


def test_the_summary_of_a_fresh_run(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text("")
    records = [{"step": s, "reward": s / 10} for s in range(1, 11)]
    lines = summary_lines(_result(tmp_path, 10, None), records, 42.4)
    assert lines == [
        "trained 10 steps in 42 s",
        "reward 0.300 -> 0.800 (mean of the first and last 5 steps of this run)",
        "final adapter: tiny-ab12-v4 in file:///s",
        f"metrics: {tmp_path / 'metrics.jsonl'}",
        f"plot: asyncgrpo plot {tmp_path}",
    ]


def test_the_summary_of_a_resumed_run_counts_this_runs_steps(tmp_path: Path) -> None:
    records = [{"step": s, "reward": 1.0 if s > 20 else 0.0} for s in range(1, 26)]
    lines = summary_lines(_result(tmp_path, 25, 20), records, 9.0)
    assert (
        lines[0]
        == "trained 5 steps in 9 s (resumed from the checkpoint of step 20; 25 steps in all)"
    )
    assert lines[1].startswith("reward 1.000 -> 1.000")  # steps 21-25 only
    assert not any(line.startswith("metrics:") for line in lines)  # logging.jsonl off


def test_a_launched_jobs_lines_are_read_back_by_the_launcher() -> None:
    out = io.StringIO()
    job = JobLines(5, stream=out)
    job.phase("model m: found")
    job.step(2, {"reward": 0.5})
    phase, step = out.getvalue().splitlines()
    assert phase == "model m: found" and parse_progress(phase) is None
    assert parse_progress(step) == {"step": 2, "max_steps": 5, "reward": 0.5}


def _read_until(fd: int, text: str, timeout_s: float) -> str:
    """What the terminal shows once ``text`` arrived (or the time ran out): the kernel hands a
    pseudo-terminal's output to its reader asynchronously, so one read may see only part of
    what was written (on a busy host, the first line alone)."""
    import os
    import select
    import time

    shown, deadline = "", time.monotonic() + timeout_s
    while text not in shown and (left := deadline - time.monotonic()) > 0:
        if select.select([fd], [], [], left)[0]:
            shown += os.read(fd, 65536).decode()
    return shown


def test_a_terminal_of_no_width_gets_one_line_per_step() -> None:
    """Some CI and container pseudo-terminals report 0 columns: a bar sized to the width
    would draw nothing there."""
    import fcntl
    import os
    import struct
    import termios

    master, slave = os.openpty()
    try:
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 0, 0, 0, 0))
        with open(slave, "w", closefd=False) as stream, ConsoleProgress(2, stream=stream) as p:
            assert stream.isatty() and os.get_terminal_size(slave).columns == 0
            p.step(1, {"reward": 0.25})
            p.step(2, {"reward": 0.5})
        shown = _read_until(master, "step 2/2  reward 0.500", timeout_s=10.0)
    finally:
        os.close(master)
        os.close(slave)
    assert "step 1/2  reward 0.250" in shown and "step 2/2  reward 0.500" in shown, shown


def test_the_summary_names_the_held_out_result_the_peft_directory_and_the_metrics(
    tmp_path: Path,
) -> None:
    (tmp_path / "metrics.jsonl").write_text("")
    result = RunResult(
        run_dir=tmp_path,
        adapter_prefix="tiny-ab12",
        steps=10,
        final_version=10,
        resumed_from_step=None,
        transport_url="file:///s",
        adapter_dir=tmp_path / "adapter",
    )
    records = [{"step": s, "reward": s / 10} for s in range(1, 11)]
    evals = [
        {"eval/version": 0.0, "eval/reward": 0.125, "eval/pass@1": 0.1, "eval/prompts": 4.0},
        {"eval/version": 10.0, "eval/reward": 0.5, "eval/pass@1": 0.4, "eval/prompts": 4.0},
    ]
    lines = summary_lines(result, records, 42.0, evals=evals)
    assert lines == [
        "trained 10 steps in 42 s",
        "reward 0.300 -> 0.800 (mean of the first and last 5 steps of this run)",
        "held-out reward: 0.125 (version 0) -> 0.500 (version 10) over 4 prompts the trainer "
        "never saw; pass@1 0.10 -> 0.40",
        "final adapter: tiny-ab12-v10 in file:///s",
        f"PEFT directory: {tmp_path / 'adapter'}",
        f"metrics: {tmp_path / 'metrics.jsonl'}",
        f"plot: asyncgrpo plot {tmp_path}",
    ]


def test_a_launched_jobs_result_line_gives_the_launcher_the_same_summary(tmp_path: Path) -> None:
    from asyncgrpo.run.progress import parse_result, result_line

    result = RunResult(
        run_dir=tmp_path / "run",
        adapter_prefix="tiny-ab12",
        steps=3,
        final_version=3,
        resumed_from_step=None,
        transport_url="s3://b/run",
        adapter_dir=tmp_path / "run" / "adapter",
    )
    evals = [
        {"eval/version": 0, "eval/reward": 0.25, "model": "tiny-ab12-v0"},
        {"eval/version": 1, "eval/reward": 0.3},
        {"eval/version": 3, "eval/reward": 0.5},
    ]
    line = "2026-01-01 12:00:00 INFO x: " + result_line(result, evals)
    parsed = parse_result(line)
    assert parsed == (
        result,
        [{"eval/version": 0, "eval/reward": 0.25}, {"eval/version": 3, "eval/reward": 0.5}],
    )
    assert parse_result("trained 3 steps") is None
    remote = summary_lines(
        result, [], 1.0, evals=parsed[1], where=" (on the trainer job's machine)"
    )
    assert (
        f"PEFT directory: {tmp_path / 'run' / 'adapter'} (on the trainer job's machine)" in remote
    )
    assert f"metrics: {tmp_path / 'run' / 'metrics.jsonl'} (on the trainer job's machine)" in remote
