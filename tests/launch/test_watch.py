"""The watch's decisions about a job that ended, and when the watch is over: no I/O."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncgrpo.errors import LaunchError
from asyncgrpo.launch.jobs import Job, JobSpec, JobStatus, Role
from asyncgrpo.launch.watch import WatchState, decide


def job(role: Role, name: str = "run-job", id: str = "j1") -> Job:
    return Job(JobSpec(role=role, name=name, command=("true",)), id, Path(f"{name}.log"))


def test_a_running_job_needs_nothing_whatever_its_role() -> None:
    for role in ("replica", "proxy", "trainer"):
        for stage in ("starting", "running"):
            assert (
                decide(job(role), JobStatus(stage), sweep=True, restarts=0, budget=3).verdict
                == "running"
            )


def test_a_replica_that_ends_is_replaced_until_the_budget_is_spent() -> None:
    failed = JobStatus("failed", message="exit code -9")
    first = decide(job("replica"), failed, sweep=False, restarts=2, budget=3)
    assert (first.verdict, first.why) == ("replace", "failed during the run (exit code -9)")
    spent = decide(job("replica"), failed, sweep=False, restarts=3, budget=3)
    assert spent.verdict == "fail"
    assert spent.why == (
        "failed during the run (exit code -9); launch.replica_restarts=3 replacements used"
    )
    # a replica that completes (it should serve until cancelled) is an end like any other
    assert (
        decide(job("replica"), JobStatus("completed"), sweep=False, restarts=0, budget=1).verdict
        == "replace"
    )
    # no budget at all: the failure says nothing of replacements
    none = decide(job("replica"), failed, sweep=False, restarts=0, budget=0)
    assert none == type(none)("fail", "failed during the run (exit code -9)")


def test_why_the_launcher_gave_up_on_a_job_wins_over_its_stage() -> None:
    replacement = job("replica")
    replacement.failure = "not healthy after 30 s"
    got = decide(replacement, JobStatus("canceled"), sweep=False, restarts=1, budget=1)
    assert got.why == "not healthy after 30 s; launch.replica_restarts=1 replacements used"


def test_a_trainer_completing_is_done_failing_fails_the_launch_or_one_point() -> None:
    trainer = job("trainer")
    assert (
        decide(trainer, JobStatus("completed"), sweep=False, restarts=0, budget=0).verdict
        == "completed"
    )
    assert decide(trainer, JobStatus("failed"), sweep=False, restarts=0, budget=3).verdict == "fail"
    assert (
        decide(trainer, JobStatus("canceled"), sweep=True, restarts=0, budget=3).verdict
        == "point_failed"
    )
    # a sweep's proxy ending ends the launch: every point sends to it
    assert (
        decide(job("proxy"), JobStatus("completed"), sweep=True, restarts=0, budget=3).verdict
        == "fail"
    )


def test_the_watch_is_over_once_every_trainer_ended_keeping_the_failed_points() -> None:
    a, b, replica = job("trainer", "a", "1"), job("trainer", "b", "2"), job("replica", "r", "3")
    state = WatchState([a, b])
    assert state.watched(a) and state.watched(replica) and not state.over
    error = LaunchError("trainer job a failed")
    state.trainer_ended(a, error)
    assert not state.watched(a) and state.watched(b) and not state.over
    state.trainer_ended(b)
    assert state.over and state.failed == [error]
    replica.replaced_by = "r2"
    assert not state.watched(replica)


@pytest.mark.parametrize("trainers", [[], [job("trainer")]])
def test_no_trainer_left_to_wait_for(trainers: list[Job]) -> None:
    state = WatchState(trainers)
    for t in trainers:
        state.trainer_ended(t)
    assert state.over


class _Front:
    """Records what the replacer asks of the proxy in front."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    async def update(self, action: str, url: str) -> None:
        self.calls.append((action, url))


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_only_a_replica_that_ran_counts_as_relaunched_by_its_backend(
    anyio_backend: str,
) -> None:
    import anyio

    from asyncgrpo.config.launch import LaunchConfig
    from asyncgrpo.launch.replacement import ReplicaReplacer

    front = _Front()
    replacer = ReplicaReplacer(None, front, LaunchConfig(), lambda j, tg: None)  # type: ignore[arg-type]
    new = job("replica", id="new")
    new.url = "https://new--8000.hf.jobs"  # a Jobs URL is known while the job is scheduled
    ran = job("replica", id="ran")
    ran.url = "http://10.0.0.2:8000"
    async with anyio.create_task_group() as tg:
        replacer.note(new, "starting", JobStatus("starting", url=new.url), tg)
        replacer.note(ran, "running", JobStatus("starting"), tg)  # SkyPilot: RECOVERING
    assert new.url == "https://new--8000.hf.jobs"
    assert front.calls == [("remove", "http://10.0.0.2:8000")] and ran.url is None
