"""Waiting for a started job to answer ``/health`` through its URL.

A job that ends first, or misses ``launch.health_timeout_s``, is a :class:`LaunchError` with its
log's tail (:func:`~asyncgrpo.launch.failure.job_failure`): the launcher's only view of why.
"""

from __future__ import annotations

import logging

import anyio

from asyncgrpo.config.launch import LaunchConfig
from asyncgrpo.errors import LaunchError
from asyncgrpo.launch.failure import job_failure
from asyncgrpo.launch.jobs import TERMINAL, Backend, Job
from asyncgrpo.vllm.health import wait_healthy

__all__ = ["not_healthy_in_time", "wait_all_healthy", "wait_job_healthy"]

logger = logging.getLogger(__name__)


def not_healthy_in_time(lcfg: LaunchConfig) -> str:
    return f"not healthy after {lcfg.health_timeout_s:.0f} s"


async def wait_job_healthy(backend: Backend, job: Job, lcfg: LaunchConfig) -> None:
    """Return once ``job`` is healthy, its URL set; else raise its failure."""

    async def url() -> str | None:
        status = await backend.status(job)
        job.stage = status.stage
        if status.stage in TERMINAL:
            why = f" ({status.message})" if status.message else ""
            what = f"{status.stage} before it was healthy{why}"
            raise await job_failure(backend, job, what, lcfg.log_tail_lines)
        job.url = job.url or status.url
        return job.url

    if not await wait_healthy(
        url,
        timeout_s=lcfg.health_timeout_s,
        interval_s=lcfg.poll_s,
        headers=backend.health_headers,
    ):
        what = (
            f"{not_healthy_in_time(lcfg)} (raise launch.health_timeout_s if the image or "
            "model is large)"
        )
        raise await job_failure(backend, job, what, lcfg.log_tail_lines)
    logger.info("%s healthy at %s", job.name, job.url)


async def wait_all_healthy(backend: Backend, jobs: list[Job], lcfg: LaunchConfig) -> None:
    """Wait for every one of ``jobs`` at once; the first failure stops the others' waits and
    is raised alone (not in an exception group)."""
    failures: list[LaunchError] = []
    async with anyio.create_task_group() as tg:

        async def healthy(job: Job) -> None:
            try:
                await wait_job_healthy(backend, job, lcfg)
            except LaunchError as exc:
                failures.append(exc)
                tg.cancel_scope.cancel()

        for job in jobs:
            tg.start_soon(healthy, job)
    if failures:
        raise failures[0]
