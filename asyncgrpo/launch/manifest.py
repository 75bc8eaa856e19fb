"""``launch/jobs.json``: what a launch started, so a person can find and stop it by hand, and
``asyncgrpo plot`` can find each run's metrics from the launch directory.

Pure: the document and its reading; writing it is :meth:`asyncgrpo.launch.job_set.JobSet.save`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from asyncgrpo.launch.jobs import Job

__all__ = ["MANIFEST_FILE", "manifest", "trainer_metrics"]

MANIFEST_FILE = "jobs.json"


def manifest(
    backend: str,
    jobs: list[Job],
    metrics: Mapping[str, Path | None],
    *,
    base: Path | None = None,
) -> dict[str, Any]:
    """The manifest of ``jobs``; ``metrics``: job name -> its run's ``metrics.jsonl`` on this
    host (trainer jobs whose run directory is here). Paths inside ``base`` (the manifest's own
    directory) are written relative to it, so that a launch directory copied or moved elsewhere
    still finds its logs and metrics."""

    def where(path: Path | str) -> str:
        return _relative(Path(path), base)

    return {
        "backend": backend,
        "jobs": [
            {
                "name": j.name,
                "role": j.spec.role,
                "id": j.id,
                "url": j.url,
                "log": where(j.log_path),
                **({"metrics": where(m)} if (m := metrics.get(j.name)) is not None else {}),
                **({"replaces": j.replaces} if j.replaces else {}),
                **({"replaced_by": j.replaced_by} if j.replaced_by else {}),
            }
            for j in jobs
        ],
    }


def _relative(path: Path, base: Path | None) -> str:
    if base is not None and path.is_absolute() and path.is_relative_to(base):
        return str(path.relative_to(base))
    return str(path)


def trainer_metrics(doc: object, base: Path | None = None) -> dict[str, Path]:
    """Run name -> ``metrics.jsonl`` path of every trainer job of a manifest that has one,
    a relative path taken from ``base`` (the manifest's directory); ``ValueError`` if ``doc``
    is no manifest."""
    jobs = doc.get("jobs") if isinstance(doc, Mapping) else None
    if not isinstance(jobs, list):
        raise ValueError("no list of jobs")
    out: dict[str, Path] = {}
    for job in jobs:
        if isinstance(job, dict) and job.get("role") == "trainer" and job.get("metrics"):
            path = Path(job["metrics"])
            out[str(job["name"]).removesuffix("-trainer")] = (
                base / path if base is not None and not path.is_absolute() else path
            )
    return out
