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

The pieces: :mod:`.job_set` (start, record, cancel the jobs), :mod:`.health` (the health
waits), :mod:`.log_follower`, :mod:`.watch` (what to do about a job that ended),
:mod:`.replacement` and :mod:`.front_proxy` (replacing a replica), :mod:`.failure` (the
messages). :class:`LaunchHandle` composes them.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import TaskGroup

from asyncgrpo.config.launch import LAUNCH_BACKENDS
from asyncgrpo.config.redaction import redact_text
from asyncgrpo.config.training import TrainingConfig
from asyncgrpo.errors import ConfigError, LaunchError
from asyncgrpo.launch.failure import job_failure, points_failure
from asyncgrpo.launch.front_proxy import FrontProxy
from asyncgrpo.launch.health import wait_all_healthy, wait_job_healthy
from asyncgrpo.launch.job_set import JobSet
from asyncgrpo.launch.jobs import Backend, Job, JobSpec
from asyncgrpo.launch.log_follower import LogFollower
from asyncgrpo.launch.replacement import ReplicaReplacer, restart_delay
from asyncgrpo.launch.sweep import Point, fleet_config, sweep_points
from asyncgrpo.launch.watch import WatchState, decide
from asyncgrpo.run.progress import describe_progress, parse_progress, parse_result
from asyncgrpo.store.run_documents import RunResult
from asyncgrpo.transport import check_transport_url

__all__ = [
    "LaunchHandle",
    "check_offline",
    "dry_run",
    "launch",
    "launch_dir",
    "make_backend",
    "plan",
    "restart_delay",
]

logger = logging.getLogger(__name__)

#: A name of :data:`~asyncgrpo.config.launch.LAUNCH_BACKENDS`.
BackendName = str
ProgressHook = Callable[[dict[str, Any]], None]
#: Seconds the trainer's log may take to drain after its job completed.
DRAIN_S = 15.0


def make_backend(name: str, cfg: TrainingConfig, launch_dir: Path, **options: Any) -> Backend:
    """The backend ``name`` (:data:`~asyncgrpo.config.launch.LAUNCH_BACKENDS`) for ``cfg``."""
    if name not in LAUNCH_BACKENDS:
        names = [repr(n) for n in sorted(LAUNCH_BACKENDS)]
        raise ConfigError(
            f"unknown launch backend {name!r}: use {', '.join(names[:-1])} or {names[-1]}"
        )
    module, _, cls = LAUNCH_BACKENDS[name].partition(":")
    return getattr(importlib.import_module(module), cls)(cfg, launch_dir, **options)


def plan(cfg: TrainingConfig, backend: BackendName, **options: Any) -> tuple[Backend, list[Point]]:
    """The backend, with replicas sized for every point of a sweep, and the points (one
    without a sweep). A transport URL no job could open is refused here, before any job."""
    if cfg.transport_url:
        try:
            check_transport_url(cfg.transport_url)
        except ConfigError as exc:
            raise ConfigError(f"transport_url: {exc}") from None
    points = sweep_points(cfg, None)
    be = make_backend(backend, fleet_config(cfg, points), launch_dir(cfg), **options)
    if cfg.launch.sweep:  # each point's storage under the backend's
        points = sweep_points(cfg, be.transport_url)
    return be, points


def launch_dir(cfg: TrainingConfig) -> Path:
    """A launch's own directory, ``<output_dir>/<run_name>-launch``: its jobs' logs and
    ``jobs.json``, and with the local backend each role's working directory (the trainer's run
    directory in it). Not ``<output_dir>/<run_name>``, which ``asyncgrpo train`` of the same
    config owns: a launched run and a trained one never share a directory."""
    return Path(cfg.output_dir) / f"{cfg.run_name}-launch"


def dry_run(cfg: TrainingConfig, backend: BackendName, **options: Any) -> str:
    """Every job spec the launch would start, as text; starts nothing and sends no request.
    Then :func:`check_offline`: the text is returned only if the launch would start."""
    be, points = plan(cfg, backend, **options)
    urls = [f"<replica-{i} URL>" for i in range(cfg.launch.replicas)]
    specs = [be.replica_spec(i) for i in range(cfg.launch.replicas)]
    if cfg.launch.sweep:
        specs.append(be.proxy_spec(urls))
        urls = ["<proxy URL>"]
    specs += [be.trainer_spec(urls, p.cfg if cfg.launch.sweep else None) for p in points]
    # a backend with its own task format (SkyPilot's YAML) shows that, and writes it out
    describe = getattr(be, "dry_run_text", JobSpec.describe)
    text = "\n\n".join(describe(spec) for spec in specs)
    if cfg.launch.sweep:
        text = "\n".join(f"point {p.cfg.run_name}: {p.label}" for p in points) + "\n\n" + text
    return redact_text(text)  # each part redacts its own; this is the net under all of them


def check_offline(cfg: TrainingConfig, backend: BackendName, **options: Any) -> list[str]:
    """Refuse, sending no request, what the launch would refuse before its first job: the
    recipe's checks (:func:`asyncgrpo.run.preflight.dry_run`; for a backend whose trainer runs
    elsewhere, what only that machine can tell is a warning) and the backend's own (an unset
    ``transport_url``, a local model path remote jobs cannot read, a secret not set). Returns
    the recipe's report lines."""
    from asyncgrpo.run.preflight import dry_run as recipe_checks

    be, _ = plan(cfg, backend, **options)
    lines = recipe_checks(cfg, here=be.name == "local")
    be.check_offline()
    return lines


async def launch(
    cfg: TrainingConfig,
    backend: BackendName | Backend = "hf-jobs",
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
    from asyncgrpo.run.lock import run_dir_lock
    from asyncgrpo.run.preflight import dry_run as recipe_checks

    if isinstance(backend, str):
        be, points = plan(cfg, backend, **options)
    else:
        be, points = backend, sweep_points(cfg, backend.transport_url)
    directory = Path(getattr(be, "launch_dir", launch_dir(cfg)))  # a backend given: its own
    await anyio.to_thread.run_sync(lambda: recipe_checks(cfg, here=be.name == "local"))
    await anyio.to_thread.run_sync(be.check)
    handle = LaunchHandle(be, cfg, directory, on_progress=on_progress, points=points)
    try:
        # one launch per directory: the second is refused at once, naming the first
        handle._owner.enter_context(
            run_dir_lock(directory, "asyncgrpo launch", setting=f"output_dir={cfg.output_dir}")
        )
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
        self.progress: list[dict[str, Any]] = []
        self._on_progress = on_progress
        self._jobs = JobSet(backend, launch_dir)
        self._front = FrontProxy(
            self._jobs, sweep=self.sweep, admin_key=backend.admin_key, poll_s=cfg.launch.poll_s
        )
        self._replacer = ReplicaReplacer(self._jobs, self._front, cfg.launch, self._follow)
        self._owner = ExitStack()  #: the launch directory's lock, held until the launch ends
        #: run name -> (its trainer's result, its first and last evaluation), from its log
        self.results: dict[str, tuple[RunResult, list[dict[str, Any]]]] = {}

    # -- what it started ---------------------------------------------------------------------

    @property
    def jobs(self) -> list[Job]:
        return self._jobs.jobs

    @property
    def replicas(self) -> list[Job]:
        return self._jobs.of_role("replica")

    @property
    def trainer(self) -> Job | None:
        return next(iter(self.trainers), None)

    @property
    def trainers(self) -> list[Job]:
        return self._jobs.of_role("trainer")

    @property
    def sweep(self) -> bool:
        return bool(self.cfg.launch.sweep)

    @property
    def front(self) -> Job | None:
        """The job whose proxy is in front of the replicas, the one replacements join: a
        sweep's proxy job, else the trainer job."""
        return self._front.job

    @property
    def front_name(self) -> str:
        return self._front.name

    @property
    def urls(self) -> list[str]:
        """The base URLs of the replicas serving (not replaced)."""
        return self._jobs.serving_urls()

    @property
    def job_ids(self) -> list[str]:
        return [j.id for j in self.jobs]

    @property
    def restarts(self) -> int:
        """Replacement replica jobs started so far."""
        return self._replacer.restarts

    @property
    def metrics(self) -> dict[str, Path | None]:
        """Run name -> its ``metrics.jsonl`` on this host (None: on the trainer job's machine),
        for each trainer job started."""
        return {
            p.cfg.run_name: self.backend.metrics_path(t)
            for p, t in zip(self.points, self.trainers, strict=False)
        }

    async def logs(self, job: Job | str, lines: int | None = None) -> str:
        """The last ``lines`` log lines of ``job`` (a :class:`Job` or its name), from the
        backend."""
        return await self.backend.log_tail(
            self._jobs.find(job), lines or self.cfg.launch.log_tail_lines
        )

    # -- starting ----------------------------------------------------------------------------

    async def _start(self) -> None:
        lcfg = self.cfg.launch
        await self.backend.prepare()
        for index in range(lcfg.replicas):
            await self._jobs.start(self.backend.replica_spec(index))
        await wait_all_healthy(self.backend, self.replicas, lcfg)
        await self._jobs.save()  # with their URLs
        urls = self.urls
        if self.sweep:  # one proxy for every point: their LoRA slots and shares in one place
            proxy = await self._jobs.start(self.backend.proxy_spec(urls))
            await wait_job_healthy(self.backend, proxy, lcfg)
            await self._jobs.save()
            self._front.note(proxy)
            urls = [str(proxy.url)]
        for point in self.points:  # the one run's trainer gets the launch's config
            await self._jobs.start(
                self.backend.trainer_spec(urls, point.cfg if self.sweep else None)
            )

    # -- watching ----------------------------------------------------------------------------

    def _on_trainer_line(self, job: Job, line: str) -> None:
        record = parse_progress(line)
        if record is None:
            if (result := parse_result(line)) is not None:
                self.results[job.name.removesuffix("-trainer")] = result
            return
        if self.sweep:
            record["run"] = job.name.removesuffix("-trainer")
        self.progress.append(record)
        logger.debug("%s", describe_progress(record))
        if self._on_progress is not None:
            self._on_progress(record)

    def _follow(self, job: Job, tg: TaskGroup) -> LogFollower:
        """Follow ``job``'s log in ``tg``: a trainer's progress lines to :attr:`progress`."""
        if job.spec.role == "trainer":
            on_line: Callable[[str], None] = lambda line: self._on_trainer_line(job, line)  # noqa: E731
        else:
            on_line = lambda line: None  # noqa: E731
        follower = LogFollower(self.backend, job, on_line)
        tg.start_soon(follower.run)
        return follower

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
                followers = {job.id: self._follow(job, tg) for job in self.jobs}
                failure, failed = await self._watch(trainers, tg)
                if failure is None:
                    with anyio.move_on_after(DRAIN_S):
                        for trainer in trainers:
                            await followers[trainer.id].drained.wait()
                tg.cancel_scope.cancel()
            if failure is None and failed:
                failure = (
                    failed[0]
                    if len(failed) == 1
                    else LaunchError(points_failure([str(f) for f in failed], len(trainers)))
                )
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
        state = WatchState(trainers)
        while True:
            for job in list(self.jobs):
                if state.watched(job) and (error := await self._poll(job, state, tg)):
                    return error, state.failed
                if state.over:
                    return None, state.failed
            await anyio.sleep(self.cfg.launch.poll_s)

    async def _poll(self, job: Job, state: WatchState, tg: TaskGroup) -> LaunchError | None:
        """Poll ``job`` once and act on what it did (:func:`~asyncgrpo.launch.watch.decide`);
        the launch's failure when it must end now."""
        lcfg = self.cfg.launch
        status = await self.backend.status(job)
        was, job.stage = job.stage, status.stage
        if job.spec.role == "replica" and job.replaced_by is None:
            self._replacer.note(job, was, status, tg)  # one the backend relaunched elsewhere
        elif self._front.moved(job, status.url):  # the front, relaunched elsewhere
            logger.warning(
                "%s (job %s) moved to %s; bringing its replicas up to date",
                self._front.name,
                job.name,
                status.url,
            )
            job.url = status.url
            tg.start_soon(self._front.resync, self._jobs.serving_urls)
        job.url = job.url or status.url
        self._front.note(job)
        decision = decide(
            job, status, sweep=self.sweep, restarts=self.restarts, budget=lcfg.replica_restarts
        )
        if decision.verdict == "replace":
            await self._replacer.replace(job, decision.why, tg)
        elif decision.verdict == "completed":
            logger.info("trainer job %s completed", job.name)
            state.trainer_ended(job)
        elif decision.verdict != "running":
            error = await job_failure(self.backend, job, decision.why, lcfg.log_tail_lines)
            if decision.verdict == "fail":
                return error
            logger.error("a sweep point failed; the other points go on: %s", error)
            state.trainer_ended(job, error)
        return None

    async def cancel(self) -> None:
        """Cancel every job of the launch that is not known to have ended, and give its
        directory up. Idempotent."""
        try:
            await self._jobs.cancel()
        finally:
            self._owner.close()

    async def __aenter__(self) -> LaunchHandle:
        return self

    async def __aexit__(self, *exc: object) -> None:
        with anyio.CancelScope(shield=True):
            await self.cancel()
