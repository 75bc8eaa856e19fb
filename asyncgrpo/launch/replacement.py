"""Replacing a replica job that ended mid-run, while training goes on with the others.

The dead replica's URL leaves the proxy in front of the replicas at once; after a doubling
delay (:func:`restart_delay`) a new replica job starts under the next name, and once healthy its
URL joins that proxy, which replays the current adapter versions to it before it takes
requests. A replacement that ends or is not healthy in time is left to the watch, like any
replica job that ended (another replacement, or the launch fails).

A replica job the backend relaunches by itself on another machine (SkyPilot's managed-job
recovery after a preemption: it reports ``starting`` again, then runs at a new address) is no
replacement: its old address leaves the proxy as soon as it is seen, and the new one joins
once healthy, the same way.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import anyio
from anyio.abc import TaskGroup

from asyncgrpo.config.launch import LaunchConfig
from asyncgrpo.errors import LaunchError
from asyncgrpo.launch.failure import fetch_tail
from asyncgrpo.launch.front_proxy import FrontProxy
from asyncgrpo.launch.health import not_healthy_in_time, wait_job_healthy
from asyncgrpo.launch.job_set import JobSet
from asyncgrpo.launch.jobs import TERMINAL, Job, JobSpec, JobStatus, Stage
from asyncgrpo.retry import Backoff

__all__ = ["MAX_RESTART_DELAY_S", "ReplicaReplacer", "restart_delay"]

logger = logging.getLogger(__name__)

#: Longest delay before a replacement replica job starts.
MAX_RESTART_DELAY_S = 600.0


def restart_delay(n: int, base_s: float) -> float:
    """Seconds before the ``n``-th replacement (from 1) starts: ``base_s``, doubled for each
    further one, at most :data:`MAX_RESTART_DELAY_S`."""
    return Backoff(base_s, max_s=MAX_RESTART_DELAY_S).delay(n)


class ReplicaReplacer:
    """Starts replacements for the replica jobs of ``jobs``; :attr:`restarts` counts them.
    ``follow(job, tg)`` starts following a new job's log in ``tg``."""

    def __init__(
        self,
        jobs: JobSet,
        front: FrontProxy,
        lcfg: LaunchConfig,
        follow: Callable[[Job, TaskGroup], object],
    ) -> None:
        self.jobs = jobs
        self.front = front
        self.lcfg = lcfg
        self.follow = follow
        self.restarts = 0
        self._recovering: set[str] = set()  #: ids of replica jobs relaunched, not yet back

    def note(self, job: Job, was: Stage, status: JobStatus, tg: TaskGroup) -> None:
        """``job`` (a replica, not replaced), last seen at stage ``was``, was polled at
        ``status``: if it ran and the backend is relaunching it elsewhere, or it runs at a new
        address, its old address leaves the proxy; once it runs again, it rejoins when healthy
        (in ``tg``)."""
        moved = status.url is not None and job.url is not None and status.url != job.url
        if was == "running" and job.url is not None and (status.stage == "starting" or moved):
            logger.warning(
                "replica job %s (%s) is being relaunched by the backend (%s); "
                "training continues on the other replicas",
                job.name,
                job.id,
                status.message or status.stage,
            )
            tg.start_soon(self.front.update, "remove", job.url)
            job.url = None
            self._recovering.add(job.id)
        if job.id in self._recovering and status.stage == "running" and status.url:
            self._recovering.discard(job.id)
            tg.start_soon(self._rejoin, job)

    async def _rejoin(self, job: Job) -> None:
        try:
            await wait_job_healthy(self.jobs.backend, job, self.lcfg)
        except LaunchError:
            return  # it ended again, or is not healthy: the watch decides
        assert job.url is not None
        await self.jobs.save()  # with its new URL
        await self.front.update("add", job.url)
        logger.info(
            "replica job %s, relaunched, is in %s at %s", job.name, self.front.name, job.url
        )

    async def replace(self, dead: Job, why: str, tg: TaskGroup) -> None:
        """Start bringing up a replacement for ``dead`` (after its delay) in ``tg``; returns at
        once, so the watch goes on."""
        lcfg = self.lcfg
        self.restarts += 1
        delay = restart_delay(self.restarts, lcfg.replica_restart_backoff_s)
        spec = self.jobs.backend.replica_spec(lcfg.replicas + self.restarts - 1)
        dead.replaced_by = spec.name
        await fetch_tail(self.jobs.backend, dead, lcfg.log_tail_lines)  # kept in its log file
        logger.warning(
            "replica job %s (%s) %s; training continues on the other replicas; replacement "
            "%d of launch.replica_restarts=%d (%s) starts in %.0f s; its log: %s",
            dead.name,
            dead.id,
            why,
            self.restarts,
            lcfg.replica_restarts,
            spec.name,
            delay,
            dead.log_path,
        )
        await self.jobs.save()
        if dead.url is not None:
            tg.start_soon(self.front.update, "remove", dead.url)
        tg.start_soon(self._bring_up, spec, dead, delay, tg)

    async def _bring_up(self, spec: JobSpec, dead: Job, delay: float, tg: TaskGroup) -> None:
        await anyio.sleep(delay)
        job = await self.jobs.start(spec, replaces=dead.name)
        self.follow(job, tg)
        try:
            await wait_job_healthy(self.jobs.backend, job, self.lcfg)
        except LaunchError:
            if job.stage not in TERMINAL:  # not healthy in time: give up on it
                job.failure = not_healthy_in_time(self.lcfg)
                job.cancel_requested = True
                await self.jobs.backend.cancel(job)
            return
        assert job.url is not None
        await self.jobs.save()  # with its URL
        await self.front.update("add", job.url)
        logger.info(
            "replica job %s (replacing %s) is in %s at %s",
            job.name,
            dead.name,
            self.front.name,
            job.url,
        )
