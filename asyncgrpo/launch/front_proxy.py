"""The proxy in front of a launch's replicas, as the launcher reaches it: its admin route
``/proxy/upstreams`` adds a replacement replica's URL and removes a dead one's.

That proxy is a sweep's proxy job, else the trainer job's own proxy. It may not answer for a
while (a trainer job still installing or loading its model), so each call retries until it
does; a refusal is logged and the run goes on with the replicas it has.

A front the backend relaunched on another machine (SkyPilot recovering the trainer job) comes
back with the replicas its command names, those of the launch's start: :meth:`FrontProxy.resync`
then makes its fleet the replicas serving now.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Literal

import anyio

from asyncgrpo.errors import ConfigError, ReplicaError
from asyncgrpo.launch.job_set import JobSet
from asyncgrpo.launch.jobs import Job
from asyncgrpo.proxy.admin_client import ProxyClient, update_proxy
from asyncgrpo.retry import poll_until

__all__ = ["ADMIN_WARN_S", "FrontProxy"]

logger = logging.getLogger(__name__)

#: Seconds between two warnings that the proxy in front of the replicas cannot be reached yet.
ADMIN_WARN_S = 60.0


class FrontProxy:
    """The job whose proxy fronts the replicas of ``jobs``, and the admin calls to it."""

    def __init__(self, jobs: JobSet, *, sweep: bool, admin_key: str | None, poll_s: float):
        self.jobs = jobs
        self.role: Literal["proxy", "trainer"] = "proxy" if sweep else "trainer"
        self.name = "the sweep's proxy" if sweep else "the trainer's proxy"
        self.admin_key = admin_key
        self.poll_s = poll_s
        self._url_known = anyio.Event()

    @property
    def job(self) -> Job | None:
        return next(iter(self.jobs.of_role(self.role)), None)

    def note(self, job: Job) -> None:
        """``job`` was polled: if it is the front and its URL is known, calls may go out."""
        if job is self.job and job.url is not None:
            self._url_known.set()

    async def update(self, action: Literal["add", "remove"], url: str) -> None:
        """Add ``url`` to, or remove it from, the proxy; retried until it answers."""
        await self._url_known.wait()
        front = self.job
        assert front is not None and front.url is not None
        warned = -ADMIN_WARN_S
        where = "to" if action == "add" else "from"

        def on_retry(error: str) -> None:
            nonlocal warned
            if anyio.current_time() - warned >= ADMIN_WARN_S:
                warned = anyio.current_time()
                logger.warning(
                    "could not %s replica %s %s %s yet (retrying): %s",
                    action,
                    url,
                    where,
                    self.name,
                    error,
                )

        try:
            await update_proxy(
                front.url,
                self.admin_key,
                url,
                remove=action == "remove",
                interval_s=self.poll_s,
                on_retry=on_retry,
            )
        except (ConfigError, ReplicaError) as exc:
            logger.error("could not %s replica %s %s %s: %s", action, url, where, self.name, exc)

    def moved(self, job: Job, url: str | None) -> bool:
        """Whether ``job`` is the front and now answers at ``url``, another address than the
        one known (the backend relaunched it elsewhere)."""
        return job is self.job and None not in (url, job.url) and url != job.url

    async def resync(self, serving: Callable[[], list[str]]) -> None:
        """Once the front answers again, remove from it the replicas not ``serving()`` and add
        those missing (a relaunched front starts with the upstreams its command names)."""
        front = self.job
        assert front is not None and front.url is not None

        async def upstreams() -> list[str] | None:
            try:  # its URL as it is now: the backend may move it again
                async with ProxyClient(str(front.url), api_key=self.admin_key, timeout_s=30) as c:
                    return await c.proxy_upstreams()
            except ReplicaError:
                return None

        try:
            listed = await poll_until(upstreams, every=self.poll_s)
        except ConfigError as exc:
            logger.error("could not resync %s: %s", self.name, exc)
            return
        assert listed is not None  # no deadline: only an answer ends the wait
        want = serving()
        for url in listed:
            if url not in want:
                await self.update("remove", url)
        for url in want:
            if url not in listed:
                await self.update("add", url)
        logger.info(
            "%s, relaunched at %s, has the replicas serving: %s",
            self.name,
            front.url,
            ", ".join(want),
        )
