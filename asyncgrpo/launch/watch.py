"""What the launch does when a job it polls has ended: the watch's decisions, without I/O.

A replica that ends is replaced while ``launch.replica_restarts`` allows; a sweep's trainer
that fails is one failed point (the others go on); any other job that ends early ends the
launch. The watch is over once every trainer has ended.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from asyncgrpo.errors import LaunchError
from asyncgrpo.launch.jobs import TERMINAL, Job, JobStatus

__all__ = ["Decision", "WatchState", "decide"]

#: running: nothing to do; completed: a trainer is done; replace: start a replacement
#: replica; point_failed: a sweep's trainer failed, the others go on; fail: the launch fails.
Verdict = Literal["running", "completed", "replace", "point_failed", "fail"]


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    why: str = ""  #: what happened to the job, for its failure message


def decide(job: Job, status: JobStatus, *, sweep: bool, restarts: int, budget: int) -> Decision:
    """What to do about ``job`` at ``status``, ``restarts`` replacements of the ``budget``
    (``launch.replica_restarts``) spent."""
    if status.stage not in TERMINAL:
        return Decision("running")
    role = job.spec.role
    if role == "trainer" and status.stage == "completed":
        return Decision("completed")
    why = job.failure or f"{status.stage} during the run" + (
        f" ({status.message})" if status.message else ""
    )
    if role == "replica":
        if restarts < budget:
            return Decision("replace", why)
        if budget:
            why += f"; launch.replica_restarts={budget} replacements used"
    if role == "trainer" and sweep:
        return Decision("point_failed", why)
    return Decision("fail", why)


@dataclass
class WatchState:
    """The trainers that have ended, and the failures of a sweep's points among them."""

    trainers: list[Job]
    ended: set[str] = field(default_factory=set)
    failed: list[LaunchError] = field(default_factory=list)

    def watched(self, job: Job) -> bool:
        """Whether ``job`` is still polled: not replaced, not a trainer that has ended."""
        return job.replaced_by is None and job.id not in self.ended

    def trainer_ended(self, job: Job, failure: LaunchError | None = None) -> None:
        self.ended.add(job.id)
        if failure is not None:
            self.failed.append(failure)

    @property
    def over(self) -> bool:
        return all(t.id in self.ended for t in self.trainers)
