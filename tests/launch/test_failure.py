"""A failed job's message always carries its log's tail, or says the log is empty and where."""

from __future__ import annotations

from pathlib import Path

from asyncgrpo.launch.failure import failure_message, points_failure
from asyncgrpo.launch.jobs import Job, JobSpec

LOG = Path("runs/r/launch/r-0-trainer.log")


def trainer(name: str = "r-0-trainer") -> Job:
    return Job(JobSpec(role="trainer", name=name, command=("true",)), "pid-7", LOG)


def test_the_jobs_own_error_line_comes_first_and_its_tail_below() -> None:
    tail = "loading\npython -m asyncgrpo.run.job: error: model='m': no such directory here\n"
    text = failure_message(trainer(), "failed during the run (exit code 2)", tail)
    first, *below = text.splitlines()
    assert first == (
        "trainer job r-0-trainer (pid-7) failed during the run (exit code 2): "
        f"model='m': no such directory here; log {LOG}, last lines:"
    )
    assert below == tail.splitlines()


def test_a_cause_announcing_lines_below_does_not_end_the_first_line_with_it() -> None:
    tail = (
        "python -m asyncgrpo.serve: error: vLLM replica 0 (port 1) not healthy after 600 s; "
        "full log: replica-0.log, last lines:\nTraceback\nOSError: no space"
    )
    first = failure_message(trainer(), "failed", tail).splitlines()[0]
    assert first == (
        "trainer job r-0-trainer (pid-7) failed: vLLM replica 0 (port 1) not healthy "
        f"after 600 s; full log: replica-0.log; log {LOG}, last lines:"
    )


def test_an_empty_log_is_said_to_be_empty_with_where_it_is() -> None:
    for tail in ("", "\n  \n"):
        text = failure_message(trainer(), "failed during the run (exit code 2)", tail)
        assert text == (
            "trainer job r-0-trainer (pid-7) failed during the run (exit code 2); "
            f"its log is empty (log file {LOG})"
        )
    text = failure_message(trainer(), "failed", "", fetch_error="HTTP 503")
    assert text.endswith(f"; could not fetch its log (HTTP 503); log file {LOG}")


def test_a_sweeps_failed_points_each_keep_their_tail() -> None:
    one = failure_message(trainer("r-0-trainer"), "failed", "Traceback\nRuntimeError: boom 0")
    two = failure_message(trainer("r-1-trainer"), "failed", "")
    assert points_failure([one], 3) == one
    text = points_failure([one, two], 3)
    assert text.splitlines()[0] == "2 of 3 sweep points failed:"
    assert "last lines:\nTraceback\nRuntimeError: boom 0\n" in text
    assert text.endswith(f"its log is empty (log file {LOG})")
