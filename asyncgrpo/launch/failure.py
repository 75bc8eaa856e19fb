"""A failed job's message: its own last error line first, then its log's tail.

Whoever reads a launch's failure is on the launcher's machine, often with no other way to see a
job's log (a Jobs machine is gone once the job ends), so the message always carries the tail,
or says plainly that the log is empty and where the file is.
"""

from __future__ import annotations

import re

import anyio

from asyncgrpo.errors import LaunchError
from asyncgrpo.launch.jobs import Backend, Job

__all__ = ["failure_message", "fetch_tail", "job_failure", "keep_tail", "points_failure"]

#: The one-line error every asyncgrpo command ends with (``asyncgrpo.console``).
_ERROR_LINE = re.compile(r": error: (?P<cause>.+)$")


def failure_message(job: Job, what: str, tail: str, *, fetch_error: str | None = None) -> str:
    """``<role> job <name> (<id>) <what>: <its last error line>; log <path>, last lines:`` and
    the tail below; for an empty tail (or one that could not be fetched), a line that says so."""
    causes = [m["cause"] for line in tail.splitlines() if (m := _ERROR_LINE.search(line))]
    head = f"{job.spec.role} job {job.name} ({job.id}) {what}"
    if causes:  # a cause that ends by announcing lines below: they are in the tail below
        head += f": {causes[-1].removesuffix('last lines:').rstrip(' ,;:')}"
    if fetch_error is not None:
        return f"{head}; could not fetch its log ({fetch_error}); log file {job.log_path}"
    if not tail.strip():
        return f"{head}; its log is empty (log file {job.log_path})"
    return f"{head}; log {job.log_path}, last lines:\n{tail.rstrip()}"


def points_failure(failed: list[str], points: int) -> str:
    """A sweep's failed points, each with its own message (log tail included)."""
    if len(failed) == 1:
        return failed[0]
    return f"{len(failed)} of {points} sweep points failed:\n" + "\n".join(failed)


async def keep_tail(job: Job, tail: str) -> None:
    """Write ``tail`` to the job's log file if the launcher has nothing there yet (a job that
    ended before its log was followed), so the file the message names holds what it showed."""
    path = anyio.Path(job.log_path)
    if not tail.strip():
        return
    if not await path.exists() or not (await path.read_text(errors="replace")).strip():
        await path.write_text(tail + "\n")


async def fetch_tail(backend: Backend, job: Job, lines: int) -> tuple[str, str | None]:
    """(the job's last ``lines`` log lines, kept in its log file; None) or ("", why they could
    not be fetched)."""
    try:
        tail = await backend.log_tail(job, lines)
    except Exception as exc:  # the error being reported matters more than its log
        return "", str(exc)
    await keep_tail(job, tail)
    return tail, None


async def job_failure(backend: Backend, job: Job, what: str, lines: int) -> LaunchError:
    """The :class:`LaunchError` for ``job``: ``what`` happened, with its log's last ``lines``."""
    tail, fetch_error = await fetch_tail(backend, job, lines)
    return LaunchError(failure_message(job, what, tail, fetch_error=fetch_error))
