"""``await launch(cfg, backend=...)``: start a run's jobs in order, watch them, cancel them.

The order is the same on every backend:

1. ``prepare`` (the bucket exists; a local S3 server is up);
2. start the N replica jobs, then wait until each answers ``/health`` through its URL (with the
   backend's token). A job that ends first, or misses ``launch.health_timeout_s``, fails the
   launch with its last log lines;
3. start the trainer job with the replicas' URLs filled in. A sweep (``launch.sweep``,
   :mod:`asyncgrpo.launch.sweep`) starts one proxy job in front of the replicas first, then
   one trainer job per point, each sending to that proxy: the runs share the fleet.

:meth:`LaunchHandle.wait` then follows every job's log into ``<run_dir>/launch/<job>.log``,
reports the trainers' progress lines, and returns when every trainer job completes. A replica job
that ends during the run is replaced, up to ``launch.replica_restarts`` times with a doubling
delay, while training continues on the others: the launcher takes its URL out of the proxy in
front of the replicas (the trainer job's, or a sweep's proxy job), starts a new job, waits for
its health and adds its URL (the proxy's admin route ``/proxy/upstreams``, with the backend's
admin key); the proxy replays the current adapter versions to it before it takes requests. The
launcher does this, not the trainer job: it is what holds the means to start and cancel jobs and
knows every job to cancel at the end. A sweep's trainer job that fails is reported and the other
points go on (the launch fails at the end, naming it). The trainer job ending otherwise, a
sweep's proxy job ending, or a replica job once the budget is spent, fails the launch (a launch
of the same run again resumes from its last checkpoint). Whatever ends the launch (success, a
failed job, an error, cancellation, Ctrl-C) cancels every job it started that is still running:
nothing is left billing.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import anyio
from anyio.abc import TaskGroup

from asyncgrpo.config.training import TrainingConfig
from asyncgrpo.errors import ConfigError, LaunchError, ReplicaError
from asyncgrpo.launch.jobs import TERMINAL, Backend, Job, JobSpec
from asyncgrpo.launch.sweep import Point, fleet_config, sweep_points
from asyncgrpo.run.progress import describe_progress, parse_progress
from asyncgrpo.transport import check_transport_url
from asyncgrpo.vllm.client import update_proxy, wait_healthy

logger = logging.getLogger(__name__)

#: The one-line error every asyncgrpo command ends with (``asyncgrpo.console``).
_ERROR_LINE = re.compile(r": error: (?P<cause>.+)$")
BackendName = Literal["hf-jobs", "local"]
ProgressHook = Callable[[dict[str, Any]], None]
#: Seconds the trainer's log may take to drain after its job completed.
DRAIN_S = 15.0
#: Longest delay before a replacement replica job starts.
MAX_RESTART_DELAY_S = 600.0
#: Seconds between two warnings that the proxy in front of the replicas cannot be reached yet.
ADMIN_WARN_S = 60.0


def restart_delay(n: int, base_s: float) -> float:
    """Seconds before the ``n``-th replacement (from 1) starts: ``base_s``, doubled for each
    further one, at most :data:`MAX_RESTART_DELAY_S`."""
    return min(base_s * 2 ** (n - 1), MAX_RESTART_DELAY_S)


def make_backend(
    name: BackendName | str, cfg: TrainingConfig, launch_dir: Path, **options: Any
) -> Backend:
    if name == "hf-jobs":
        from asyncgrpo.launch.hf_jobs import HfJobsBackend

        return HfJobsBackend(cfg, launch_dir, **options)
    if name == "local":
        from asyncgrpo.launch.local import LocalBackend

        return LocalBackend(cfg, launch_dir, **options)
    raise ConfigError(f"unknown launch backend {name!r}: use 'hf-jobs' or 'local'")


def plan(
    cfg: TrainingConfig, backend: BackendName | str, **options: Any
) -> tuple[Backend, list[Point]]:
    """The backend, with replicas sized for every point of a sweep, and the points (one
    without a sweep). A transport URL no job could open is refused here, before any job."""
    if cfg.transport_url:
        try:
            check_transport_url(cfg.transport_url)
        except ConfigError as exc:
            raise ConfigError(f"transport_url: {exc}") from None
    points = sweep_points(cfg, None)
    be = make_backend(backend, fleet_config(cfg, points), cfg.run_dir / "launch", **options)
    if cfg.launch.sweep:  # each point's storage under the backend's
        points = sweep_points(cfg, be.transport_url)
    return be, points


def dry_run(cfg: TrainingConfig, backend: BackendName | str, **options: Any) -> str:
    """Every job spec the launch would start, as text; starts nothing and sends no request."""
    be, points = plan(cfg, backend, **options)
    urls = [f"<replica-{i} URL>" for i in range(cfg.launch.replicas)]
    specs = [be.replica_spec(i) for i in range(cfg.launch.replicas)]
    if cfg.launch.sweep:
        specs.append(be.proxy_spec(urls))
        urls = ["<proxy URL>"]
    specs += [be.trainer_spec(urls, p.cfg if cfg.launch.sweep else None) for p in points]
    text = "\n\n".join(spec.describe() for spec in specs)
    if cfg.launch.sweep:
        text = "\n".join(f"point {p.cfg.run_name}: {p.label}" for p in points) + "\n\n" + text
    if be.missing:
        text += f"\n\nnot set here, so a real launch would refuse: {', '.join(be.missing)}"
    return text


async def launch(
    cfg: TrainingConfig,
    backend: BackendName | str | Backend = "hf-jobs",
    *,
    on_progress: ProgressHook | None = None,
    **options: Any,
) -> LaunchHandle:
    """Start the run's replica jobs, wait for their health, start the trainer job.

    Returns once the trainer job is started; ``await handle.wait()`` follows it to the end.
    ``options`` go to the backend (e.g. ``api=HfApi(endpoint=...)`` for ``hf-jobs``). If
    anything fails on the way, every job started so far is cancelled before the error
    (:class:`~asyncgrpo.errors.LaunchError` with the job's log tail) propagates.
    """
    launch_dir = cfg.run_dir / "launch"
    if isinstance(backend, str):
        be, points = plan(cfg, backend, **options)
    else:
        be, points = backend, sweep_points(cfg, backend.transport_url)
    await anyio.to_thread.run_sync(be.check)
    await anyio.Path(launch_dir).mkdir(parents=True, exist_ok=True)
    handle = LaunchHandle(be, cfg, launch_dir, on_progress=on_progress, points=points)
    try:
        await handle._start()
    except BaseException:
        with anyio.CancelScope(shield=True):
            await handle.cancel()
        raise
    return handle


class LaunchHandle:
    """A launched run: its jobs, their URLs and logs; ``wait()``, ``cancel()``.

    Also an async context manager that cancels every job on exit::

        async with await launch(cfg, backend="local") as run:
            await run.wait()
    """

    def __init__(
        self,
        backend: Backend,
        cfg: TrainingConfig,
        launch_dir: Path,
        *,
        on_progress: ProgressHook | None = None,
        points: list[Point] | None = None,
    ) -> None:
        self.backend = backend
        self.cfg = cfg
        #: the runs: one, or a sweep's points (each a trainer job on the shared fleet)
        self.points = points or [Point(cfg, "")]
        self.launch_dir = launch_dir
        self.jobs: list[Job] = []
        self.progress: list[dict[str, Any]] = []
        self.restarts = 0  #: replacement replica jobs started so far
        self._front_url = anyio.Event()  #: set once the URL of :attr:`front` is known
        self._on_progress = on_progress
        self._closed = False

    # -- what it started ---------------------------------------------------------------------

    @property
    def replicas(self) -> list[Job]:
        return [j for j in self.jobs if j.spec.role == "replica"]

    @property
    def trainer(self) -> Job | None:
        return next(iter(self.trainers), None)

    @property
    def trainers(self) -> list[Job]:
        return [j for j in self.jobs if j.spec.role == "trainer"]

    @property
    def sweep(self) -> bool:
        return bool(self.cfg.launch.sweep)

    @property
    def front(self) -> Job | None:
        """The job whose proxy is in front of the replicas, the one replacements join: a
        sweep's proxy job, else the trainer job."""
        role = "proxy" if self.sweep else "trainer"
        return next((j for j in self.jobs if j.spec.role == role), None)

    @property
    def front_name(self) -> str:
        return "the sweep's proxy" if self.sweep else "the trainer's proxy"

    @property
    def urls(self) -> list[str]:
        """The base URLs of the replicas serving (not replaced)."""
        return [j.url for j in self.replicas if j.url and j.replaced_by is None]

    @property
    def job_ids(self) -> list[str]:
        return [j.id for j in self.jobs]

    async def logs(self, job: Job | str, lines: int | None = None) -> str:
        """The last ``lines`` log lines of ``job`` (a :class:`Job` or its name), from the
        backend."""
        if isinstance(job, str):
            found = next((j for j in self.jobs if j.name == job or j.id == job), None)
            if found is None:
                raise ConfigError(f"no job {job!r}; jobs: {', '.join(j.name for j in self.jobs)}")
            job = found
        return await self.backend.log_tail(job, lines or self.cfg.launch.log_tail_lines)

    # -- starting ----------------------------------------------------------------------------

    async def _start_job(self, spec: JobSpec) -> Job:
        job_id = await self.backend.start(spec)
        job = Job(spec, job_id, self.launch_dir / f"{spec.name}.log")
        self.jobs.append(job)
        logger.info("started %s job %s (%s)", spec.role, spec.name, job_id)
        self._write_manifest()
        return job

    def _write_manifest(self) -> None:
        """``launch/jobs.json``: what was started, so a person can find and stop it by hand."""
        doc = {
            "backend": self.backend.name,
            "jobs": [
                {
                    "name": j.name,
                    "role": j.spec.role,
                    "id": j.id,
                    "url": j.url,
                    "log": str(j.log_path),
                    **({"replaces": j.replaces} if j.replaces else {}),
                    **({"replaced_by": j.replaced_by} if j.replaced_by else {}),
                }
                for j in self.jobs
            ],
        }
        (self.launch_dir / "jobs.json").write_text(json.dumps(doc, indent=2) + "\n")

    async def _start(self) -> None:
        await self.backend.prepare()
        for index in range(self.cfg.launch.replicas):
            await self._start_job(self.backend.replica_spec(index))
        failures: list[BaseException] = []
        async with anyio.create_task_group() as tg:

            async def healthy(job: Job) -> None:
                try:
                    await self._wait_healthy(job)
                except LaunchError as exc:
                    failures.append(exc)
                    tg.cancel_scope.cancel()

            for job in self.replicas:
                tg.start_soon(healthy, job)
        if failures:
            raise failures[0]
        self._write_manifest()
        urls = self.urls
        if self.sweep:  # one proxy for every point: their LoRA slots and shares in one place
            proxy = await self._start_job(self.backend.proxy_spec(urls))
            await self._wait_healthy(proxy)
            self._write_manifest()
            self._front_url.set()
            urls = [str(proxy.url)]
        for point in self.points:  # the one run's trainer gets the launch's config
            cfg = point.cfg if self.sweep else None
            await self._start_job(self.backend.trainer_spec(urls, cfg))

    async def _failure(self, job: Job, what: str) -> LaunchError:
        """The job's failure: on the first line, its own last error line when it printed one
        (an asyncgrpo command always does); its log's tail below."""
        tail = await self._save_tail(job)
        causes = [m["cause"] for line in tail.splitlines() if (m := _ERROR_LINE.search(line))]
        cause = f": {causes[-1]}" if causes else ""
        return LaunchError(
            f"{job.spec.role} job {job.name} ({job.id}) {what}{cause}; log {job.log_path}, "
            f"last lines:\n{tail}"
        )

    async def _save_tail(self, job: Job) -> str:
        try:
            tail = await self.backend.log_tail(job, self.cfg.launch.log_tail_lines)
        except Exception as exc:  # the error being reported matters more than its log
            return f"(could not fetch the log: {exc})"
        path = anyio.Path(job.log_path)
        if not await path.exists() or not (await path.read_text(errors="replace")).strip():
            await path.write_text(tail + "\n")
        return tail

    async def _wait_healthy(self, job: Job) -> None:
        lcfg = self.cfg.launch

        async def url() -> str | None:
            status = await self.backend.status(job)
            job.stage = status.stage
            if status.stage in TERMINAL:
                why = f" ({status.message})" if status.message else ""
                raise await self._failure(job, f"{status.stage} before it was healthy{why}")
            job.url = job.url or status.url
            return job.url

        if not await wait_healthy(
            url,
            timeout_s=lcfg.health_timeout_s,
            interval_s=lcfg.poll_s,
            headers=self.backend.health_headers,
        ):
            raise await self._failure(
                job,
                f"not healthy after {lcfg.health_timeout_s:.0f} s (raise "
                "launch.health_timeout_s if the image or model is large)",
            )
        logger.info("%s healthy at %s", job.name, job.url)

    # -- watching ----------------------------------------------------------------------------

    def _on_trainer_line(self, job: Job, line: str) -> None:
        record = parse_progress(line)
        if record is None:
            return
        if self.sweep:
            record["run"] = job.name.removesuffix("-trainer")
        self.progress.append(record)
        logger.debug("%s", describe_progress(record))
        if self._on_progress is not None:
            self._on_progress(record)

    def _line_handler(self, job: Job) -> Callable[[str], None]:
        if job.spec.role == "trainer":
            return lambda line: self._on_trainer_line(job, line)
        return lambda line: None

    async def _follow(self, job: Job, done: anyio.Event) -> None:
        if self.backend.writes_own_logs:
            try:
                await self.backend.follow_logs(job, self._line_handler(job))
            finally:
                done.set()
            return
        async with await anyio.open_file(job.log_path, "a", encoding="utf-8") as log:
            lines: list[str] = []
            handle_line = self._line_handler(job)

            def on_line(line: str) -> None:
                lines.append(line)
                handle_line(line)

            async def flush() -> None:
                while lines:
                    await log.write(lines.pop(0) + "\n")
                await log.flush()

            async with anyio.create_task_group() as tg:

                async def flusher() -> None:
                    while True:
                        await anyio.sleep(0.5)
                        await flush()

                tg.start_soon(flusher)
                try:
                    await self.backend.follow_logs(job, on_line)
                finally:
                    with anyio.CancelScope(shield=True):
                        await flush()
                    done.set()
                    tg.cancel_scope.cancel()

    async def wait(self) -> list[dict[str, Any]]:
        """Follow the jobs until every trainer job completes; their progress records.

        Replaces replica jobs that end, within ``launch.replica_restarts``. Raises
        :class:`~asyncgrpo.errors.LaunchError` with the log tail if a trainer job (a sweep's
        point: once the other points are done), a sweep's proxy job, or a replica job beyond
        that budget, fails or stops early. On every way out, the jobs still running are
        cancelled.
        """
        trainers = self.trainers
        if not trainers:
            raise LaunchError("the launch has no trainer job (it did not start)")
        try:
            async with anyio.create_task_group() as tg:
                drained = {job.id: anyio.Event() for job in self.jobs}
                for job in self.jobs:
                    tg.start_soon(self._follow, job, drained[job.id])
                failure, failed = await self._watch(trainers, tg)
                if failure is None:
                    with anyio.move_on_after(DRAIN_S):
                        for trainer in trainers:
                            await drained[trainer.id].wait()
                tg.cancel_scope.cancel()
            if failure is None and failed:
                failure = failed[0] if len(failed) == 1 else LaunchError(
                    f"{len(failed)} of {len(trainers)} sweep points failed:\n"
                    + "\n".join(str(f).splitlines()[0] for f in failed)
                )  # fmt: skip
            if failure is not None:
                raise failure
        finally:
            with anyio.CancelScope(shield=True):
                await self.cancel()
        return self.progress

    async def _watch(
        self, trainers: list[Job], tg: TaskGroup
    ) -> tuple[LaunchError | None, list[LaunchError]]:
        """Poll every job until each trainer has ended: (None, the failures of a sweep's
        points), or (the failure, ...) as soon as a job ends that is not to be replaced and
        the launch cannot go on without (a replica, a sweep's proxy, the one trainer)."""
        lcfg = self.cfg.launch
        front = self.front
        failed: dict[str, LaunchError] = {}
        done: set[str] = set()
        while True:
            for job in list(self.jobs):
                if job.replaced_by is not None or job.id in done:
                    continue
                status = await self.backend.status(job)
                job.stage = status.stage
                job.url = job.url or status.url
                if job is front and job.url is not None:
                    self._front_url.set()
                if status.stage not in TERMINAL:
                    continue
                if job.spec.role == "trainer" and status.stage == "completed":
                    logger.info("trainer job %s completed", job.name)
                    done.add(job.id)
                    if all(t.id in done for t in trainers):
                        return None, list(failed.values())
                    continue
                why = job.failure or f"{status.stage} during the run" + (
                    f" ({status.message})" if status.message else ""
                )
                if job.spec.role == "replica" and self.restarts < lcfg.replica_restarts:
                    await self._replace(job, why, tg)
                    continue
                if job.spec.role == "replica" and lcfg.replica_restarts:
                    why += f"; launch.replica_restarts={lcfg.replica_restarts} replacements used"
                error = await self._failure(job, why)
                if job.spec.role != "trainer" or not self.sweep:
                    return error, list(failed.values())
                logger.error("%s; the other points go on", str(error).splitlines()[0])
                failed[job.id] = error
                done.add(job.id)
                if all(t.id in done for t in trainers):
                    return None, list(failed.values())
            await anyio.sleep(lcfg.poll_s)

    # -- replacing replicas ------------------------------------------------------------------

    async def _replace(self, dead: Job, why: str, tg: TaskGroup) -> None:
        """Start bringing up a replacement for ``dead`` (after its backoff); the watch goes on."""
        lcfg = self.cfg.launch
        self.restarts += 1
        delay = restart_delay(self.restarts, lcfg.replica_restart_backoff_s)
        spec = self.backend.replica_spec(lcfg.replicas + self.restarts - 1)
        dead.replaced_by = spec.name
        await self._save_tail(dead)
        logger.warning(
            "replica job %s (%s) %s; training continues on the other replicas; replacement "
            "%d of launch.replica_restarts=%d (%s) starts in %.0f s; its log: %s",
            dead.name, dead.id, why, self.restarts, lcfg.replica_restarts, spec.name, delay,
            dead.log_path,
        )  # fmt: skip
        self._write_manifest()
        if dead.url is not None:
            tg.start_soon(self._admin, "remove", dead.url)
        tg.start_soon(self._bring_up, spec, dead, delay, tg)

    async def _bring_up(self, spec: JobSpec, dead: Job, delay: float, tg: TaskGroup) -> None:
        """Start the replacement, wait for its health, add it to the proxy in front of the
        replicas. If it ends or misses ``launch.health_timeout_s`` first, the watch treats it
        like any replica job that ended (another replacement, or the launch fails)."""
        await anyio.sleep(delay)
        job = await self._start_job(spec)
        job.replaces = dead.name
        self._write_manifest()
        tg.start_soon(self._follow, job, anyio.Event())
        try:
            await self._wait_healthy(job)
        except LaunchError:
            if job.stage not in TERMINAL:  # not healthy in time: give up on it
                job.failure = f"not healthy after {self.cfg.launch.health_timeout_s:.0f} s"
                job.cancel_requested = True
                await self.backend.cancel(job)
            return
        assert job.url is not None
        self._write_manifest()  # with its URL
        await self._admin("add", job.url)
        logger.info(
            "replica job %s (replacing %s) is in %s at %s",
            job.name, dead.name, self.front_name, job.url,
        )  # fmt: skip

    async def _admin(self, action: Literal["add", "remove"], url: str) -> None:
        """Add ``url`` to, or remove it from, the proxy in front of the replicas (:attr:`front`);
        retried until it answers (a trainer job may still be installing or loading its model).
        A refusal is logged: the run goes on with the replicas it has."""
        front = self.front
        assert front is not None
        await self._front_url.wait()
        assert front.url is not None
        warned = -ADMIN_WARN_S
        where = "to" if action == "add" else "from"

        def on_retry(error: str) -> None:
            nonlocal warned
            if anyio.current_time() - warned >= ADMIN_WARN_S:
                warned = anyio.current_time()
                logger.warning("could not %s replica %s %s %s yet (retrying): %s", action, url,
                               where, self.front_name, error)  # fmt: skip

        try:
            await update_proxy(front.url, self.backend.admin_key, url, remove=action == "remove",
                               interval_s=self.cfg.launch.poll_s, on_retry=on_retry)  # fmt: skip
        except (ConfigError, ReplicaError) as exc:
            logger.error("could not %s replica %s %s %s: %s", action, url, where,
                         self.front_name, exc)  # fmt: skip

    async def cancel(self) -> None:
        """Cancel every job of the launch that is not known to have ended. Idempotent."""
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

    async def __aenter__(self) -> LaunchHandle:
        return self

    async def __aexit__(self, *exc: object) -> None:
        with anyio.CancelScope(shield=True):
            await self.cancel()
