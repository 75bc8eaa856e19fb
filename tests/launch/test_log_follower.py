"""One job's log followed to its end: every line handled, and written in order to its file."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import anyio

from asyncgrpo.launch.jobs import Job, JobSpec
from asyncgrpo.launch.log_follower import FLUSH_S, LogFollower


class Streaming:
    """A backend that streams ``lines`` (some apart by more than a flush), as a Jobs log does."""

    def __init__(self, lines: list[str], *, writes_own_logs: bool = False) -> None:
        self.lines = lines
        self.writes_own_logs = writes_own_logs

    async def follow_logs(self, job: Job, on_line: Callable[[str], None]) -> None:
        for i, line in enumerate(self.lines):
            on_line(line)
            if i % 50 == 0:
                await anyio.sleep(FLUSH_S * 1.5)  # a flush falls between


def job(tmp_path: Path) -> Job:
    return Job(JobSpec(role="trainer", name="t", command=("true",)), "1", tmp_path / "t.log")


def test_every_line_is_handled_and_appended_in_order(tmp_path: Path) -> None:
    lines = [f"line {i}" for i in range(120)]
    seen: list[str] = []
    j = job(tmp_path)
    j.log_path.write_text("before\n")
    follower = LogFollower(Streaming(lines), j, seen.append)  # type: ignore[arg-type]
    anyio.run(follower.run)
    assert seen == lines and follower.drained.is_set()
    assert j.log_path.read_text().splitlines() == ["before", *lines]


def test_a_job_that_writes_its_own_log_is_only_read(tmp_path: Path) -> None:
    seen: list[str] = []
    j = job(tmp_path)
    follower = LogFollower(Streaming(["a", "b"], writes_own_logs=True), j, seen.append)  # type: ignore[arg-type]
    anyio.run(follower.run)
    assert seen == ["a", "b"] and follower.drained.is_set() and not j.log_path.exists()


def test_cancelled_it_still_writes_what_it_got_and_is_drained(tmp_path: Path) -> None:
    class Hangs(Streaming):
        async def follow_logs(self, job: Job, on_line: Callable[[str], None]) -> None:
            on_line("last words")
            await anyio.sleep_forever()

    j = job(tmp_path)
    follower = LogFollower(Hangs([]), j, lambda line: None)  # type: ignore[arg-type]

    async def main() -> None:
        with anyio.move_on_after(0.1):
            await follower.run()

    anyio.run(main)
    assert j.log_path.read_text() == "last words\n" and follower.drained.is_set()
