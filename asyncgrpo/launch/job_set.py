"""The jobs of one launch: started through the backend, recorded in ``launch/jobs.json``,
cancelled together.

Every job a launch starts goes through :meth:`JobSet.start`, so :meth:`JobSet.cancel` knows
each one to stop and the manifest on disk names each one, whatever ends the launch.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import anyio

from asyncgrpo.errors import ConfigError
from asyncgrpo.launch.jobs import TERMINAL, Backend, Job, JobSpec, Role
from asyncgrpo.launch.manifest import MANIFEST_FILE, manifest

__all__ = ["JobSet"]

logger = logging.getLogger(__name__)


class JobSet:
    """The started jobs of a launch, in start order."""

    def __init__(self, backend: Backend, launch_dir: Path) -> None:
        self.backend = backend
        self.launch_dir = launch_dir
        self.jobs: list[Job] = []
        self._saving = anyio.Lock()  # one write of the manifest at a time
        self._closed = False

    def of_role(self, role: Role) -> list[Job]:
        return [j for j in self.jobs if j.spec.role == role]

    def find(self, job: Job | str) -> Job:
        """``job`` itself, or the job of that name or id; unknown: :class:`ConfigError`."""
        if isinstance(job, Job):
            return job
        found = next((j for j in self.jobs if job in (j.name, j.id)), None)
        if found is None:
            raise ConfigError(f"no job {job!r}; jobs: {', '.join(j.name for j in self.jobs)}")
        return found

    def serving_urls(self) -> list[str]:
        """The base URLs of the replicas serving (not replaced)."""
        return [j.url for j in self.of_role("replica") if j.url and j.replaced_by is None]

    async def start(self, spec: JobSpec, *, replaces: str | None = None) -> Job:
        job_id = await self.backend.start(spec)
        job = Job(spec, job_id, self.launch_dir / f"{spec.name}.log", replaces=replaces)
        self.jobs.append(job)
        logger.info("started %s job %s (%s)", spec.role, spec.name, job_id)
        await self.save()
        return job

    async def save(self) -> None:
        """Write ``launch/jobs.json`` (after each change: a job started, its URL known, ...)."""
        metrics = {j.name: self.backend.metrics_path(j) for j in self.of_role("trainer")}
        doc = manifest(self.backend.name, self.jobs, metrics, base=self.launch_dir.resolve())
        text = json.dumps(doc, indent=2) + "\n"
        async with self._saving:
            await anyio.Path(self.launch_dir / MANIFEST_FILE).write_text(text)

    async def cancel(self) -> None:
        """Cancel every job not known to have ended; then close the backend. Idempotent."""
        for job in self.jobs:
            if job.stage in TERMINAL or job.cancel_requested:
                continue
            job.cancel_requested = True
            try:
                await self.backend.cancel(job)
                logger.info("cancelled %s (%s)", job.name, job.id)
            except Exception as exc:  # keep cancelling the others
                logger.error("could not cancel job %s (%s): %s", job.name, job.id, exc)
        if not self._closed:
            self._closed = True
            await self.backend.aclose()
