"""``await run_training(cfg)``: the run's phases, in order, on rank 0.

:func:`run_training` reads as the run's phases in order, each a function or async context
manager saying why it is there: open the run (transport, run id), the endpoint (local replicas
behind a proxy, or a standalone proxy it is given: :mod:`asyncgrpo.run.endpoint`), preflight checks
and adapter sync, the trainer (resumed), the first version, the sample source
(:mod:`asyncgrpo.run.sources`), the training loop, the finish. What a phase holds (transport,
replicas and proxy, loaded adapters, rollouts) sits on one exit stack, so success, an error and
cancellation all undo it in reverse order.

Elsewhere: the other data-parallel ranks (:mod:`asyncgrpo.run.follower`), the rollout processes of a
split run (:mod:`asyncgrpo.run.rollouts`), the run's documents in its transport
(:mod:`asyncgrpo.store.run_documents`).
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import anyio

from asyncgrpo.config.model_source import check_model
from asyncgrpo.config.redaction import redacted
from asyncgrpo.config.training import TrainingConfig, run_transport_url
from asyncgrpo.errors import ConfigError, IntegrityError, ReplicaError, TransportError
from asyncgrpo.evaluation.runner import eval_run
from asyncgrpo.proxy.admin_client import ProxyClient
from asyncgrpo.rollout.window import AdmissionWindow
from asyncgrpo.run.audit import ServedPolicyAudit
from asyncgrpo.run.endpoint import Endpoint, open_endpoint
from asyncgrpo.run.evaluation import EvalsDuringTraining, RunEvaluator, evals_during_training
from asyncgrpo.run.follower import follow
from asyncgrpo.run.ledger import TRAINED_FILE, Ledger
from asyncgrpo.run.lock import run_dir_lock
from asyncgrpo.run.metrics import MetricsWriter
from asyncgrpo.run.preflight import dry_run, preflight_fleet
from asyncgrpo.run.progress import RunProgress, StepCallback, as_progress
from asyncgrpo.run.sources import (
    ChannelSource,
    LocalSource,
    SampleSource,
    rollout_client,
    trainer_channel,
)
from asyncgrpo.run.sync import (
    AdapterLoader,
    AdapterSource,
    AdapterSync,
    LocalCacheSource,
    ProxyLoader,
    TransportSource,
)
from asyncgrpo.run.trackers import Tracker, TrackioTracker, WandbTracker
from asyncgrpo.sample import Sample
from asyncgrpo.store.adapters import AdapterStore
from asyncgrpo.store.checkpoints import CheckpointStore
from asyncgrpo.store.run_documents import (
    FINAL_ADAPTER_DIR,
    RunResult,
    RunStore,
    open_run_transport,
)
from asyncgrpo.trainer.staleness import filter_stale, staleness_stats
from asyncgrpo.transport import Transport, open_transport

__all__ = ["LoaderFactory", "RunResult", "StepHook", "run_training"]

logger = logging.getLogger(__name__)

KEEP_CHECKPOINTS = 2
#: Seconds the proxy may take to say how its fleet is; a step does not wait longer.
FLEET_TIMEOUT_S = 2.0
#: Seconds the trainer's own disk may refuse a sync's adapter or a checkpoint (full) before the
#: run stops: meanwhile each is put off to the next step (:class:`LocalDisk`).
DISK_PATIENCE_S = 120.0

#: Called before each optimizer step with (step, samples, adapter version), and awaited if it
#: returns an awaitable: tests use it to check served logprobs against the trainer's, and to
#: change the fleet at a given step.
StepHook = Callable[[int, Sequence[Sample], int], Awaitable[None] | None]
#: Builds the adapter loader from the proxy URL (tests inject faults here).
LoaderFactory = Callable[[str], AdapterLoader]


async def _save_adapter(trainer: Any, directory: Path, version: int) -> Path:
    """Save the weights published as ``version`` (the trainer counts staleness from it)."""
    return await anyio.to_thread.run_sync(lambda: trainer.save_adapter(directory, version=version))


@dataclass
class _Run:
    """What the phases of one run share: its settings, its storage and its adapter names."""

    cfg: TrainingConfig
    transport: Transport
    documents: RunStore  #: run.json, policy.json, done.json
    run_id: str
    prefix: str  #: vLLM names are ``<prefix>-v<N>``
    store: AdapterStore
    checkpoints: CheckpointStore
    cache_dir: Path  #: versions fetched here for replicas that share this disk
    dp: Any = None  #: the data-parallel group (None in one process)


@dataclass
class _Start:
    """The trainer and where it starts: the latest checkpoint's step and dataset position."""

    trainer: Any
    resumed_from: int | None
    position: int
    #: the checkpointed step's metrics line, for a run killed before it wrote it
    metrics: dict[str, Any] | None = None
    skip: int = 0  #: samples at ``position`` taken before the checkpoint (a batch in part)


async def run_training(
    cfg: TrainingConfig,
    *,
    rollout_source: Literal["local", "channel"] = "local",
    on_step: StepHook | None = None,
    loader_factory: LoaderFactory | None = None,
    progress: RunProgress | StepCallback | None = None,
) -> RunResult:
    """Train ``cfg`` to ``trainer.max_steps``; resumes from the latest checkpoint if any.

    Before anything starts: every check of ``--dry-run`` (:func:`~asyncgrpo.run.preflight.
    dry_run`), the run directory's lock (:func:`~asyncgrpo.run.lock.run_dir_lock`: a second run
    there is refused), and a run whose newest checkpoint is at ``max_steps`` returns at once
    (``RunResult.up_to_date``) with nothing started or published. An interruption ends with a
    phase line saying which checkpoint a rerun resumes from.

    One line per phase; the exit stack undoes them in reverse (rollouts stop, adapters unload,
    proxy and replicas stop, the transport closes) on success, an error and cancellation alike.
    ``progress`` hears of the phases before the first step and of every step
    (:mod:`asyncgrpo.run.progress`); a plain callback hears of the steps only.
    """
    report = as_progress(progress)
    _check_rollout_source(cfg, rollout_source)
    # the model first (a recipe's data may live in its directory), then every check of --dry-run
    await anyio.to_thread.run_sync(check_model, cfg.model)
    await anyio.to_thread.run_sync(dry_run, cfg)
    report.phase(f"model {cfg.model}: found")
    main = os.environ.get("RANK", "0") == "0"  # under torchrun, rank 0 owns the run directory
    with run_dir_lock(cfg.run_dir, "asyncgrpo train") if main else nullcontext():
        done = await _already_trained(cfg)
        if done is not None:  # every rank sees it: none starts anything (RunResult.up_to_date)
            logger.info(
                "the checkpoint is at step %d >= trainer.max_steps=%d: nothing to train",
                done.steps,
                cfg.trainer.max_steps,
            )
            return done
        from asyncgrpo.trainer.distributed import DataParallel

        dp = DataParallel.from_env(timeout_s=cfg.trainer.dp_timeout_s)  # None in one process
        if dp is not None and not dp.is_main:
            return await follow(cfg, dp)
        state = _Progress()
        try:
            return await _run(cfg, dp, rollout_source, on_step, loader_factory, report, state)
        except anyio.get_cancelled_exc_class():
            report.phase(state.interrupted(cfg))
            raise


async def _run(
    cfg: TrainingConfig,
    dp: Any,
    rollout_source: str,
    on_step: StepHook | None,
    loader_factory: LoaderFactory | None,
    report: RunProgress,
    state: _Progress,
) -> RunResult:
    """The run's phases on rank 0 (see the module docstring), on one exit stack."""
    async with AsyncExitStack() as stack:
        run = await stack.enter_async_context(_open_run(cfg, dp))
        endpoint = await stack.enter_async_context(
            open_endpoint(cfg, run.cache_dir, run.transport.url, phase=report.phase)
        )
        sync = await stack.enter_async_context(_adapter_sync(run, endpoint, loader_factory, report))
        work = await _scratch_dir(stack, cfg.run_dir)
        start = await _start_trainer(run, dp, work, report)
        state.step = state.checkpoint = start.resumed_from
        ledger = Ledger(cfg.run_dir / TRAINED_FILE, enabled=cfg.logging.jsonl)
        version = await _publish_first_version(run, sync, start.trainer, work, ledger)
        report.phase(f"version {version} ({sync.name(version)}) loaded on every replica")
        writer = stack.enter_context(_metrics_writer(cfg, run.prefix, start))
        source = await stack.enter_async_context(
            _sample_source(run, endpoint, rollout_source, (sync.name(version), version), start)
        )
        proxy = await stack.enter_async_context(
            ProxyClient(endpoint.url, api_key=endpoint.api_key, timeout_s=FLEET_TIMEOUT_S)
        )
        evaluator, base = await _evaluator(cfg, endpoint, writer, sync, start, run.prefix)
        every = cfg.eval.every if cfg.eval is not None else 0
        async with evals_during_training(evaluator, sync, every) as evals:
            evals.latest = base
            step, version = await _train(
                run,
                start.trainer,
                sync,
                source,
                writer,
                ledger,
                work,
                version,
                on_step=on_step,
                progress=report,
                fleet=lambda: _fleet_metrics(proxy),
                audit=_served_policy_audit(run, start.trainer, work),
                evals=evals,
                state=state,
            )
            await evals.finish(version, step)  # the final version, after the last step
        return await _finish(run, start, step, version)


@dataclass
class _Progress:
    """How far the run got: what an interruption reports (a rerun resumes from the last
    checkpoint, and trains the steps after it again)."""

    step: int | None = None  #: the last step done, its metrics line written (None: none yet)
    checkpoint: int | None = None  #: the step of the newest checkpoint (None: none)

    def interrupted(self, cfg: TrainingConfig) -> str:
        # A checkpoint saved before its step's metrics line holds that line (a resume writes it)
        last = max(self.step or 0, self.checkpoint or 0)
        at = f" at step {last}" if last else ""
        if self.checkpoint is None:
            every = cfg.trainer.save_steps
            when = f"(trainer.save_steps={every})" if every else "(trainer.save_steps=0: off)"
            return (
                f"interrupted{at}, before the first checkpoint {when}: a rerun starts from step 0"
            )
        again = ""
        if last > self.checkpoint:
            again = f"; steps {self.checkpoint + 1}-{last} are trained again"
        return (
            f"interrupted{at}: the checkpoint of step {self.checkpoint} is kept, and the same "
            f"command resumes from it{again}"
        )


async def _already_trained(cfg: TrainingConfig) -> RunResult | None:
    """The run's result when its newest checkpoint is at ``trainer.max_steps`` or beyond: a
    rerun of a finished config (or one whose ``max_steps`` was lowered) starts nothing and
    publishes nothing. Reads the transport only (a directory one that does not exist yet: no
    run)."""
    transport = open_run_transport(run_transport_url(cfg))
    if transport is None:  # no such directory: nothing has run here
        return None
    async with transport:
        step = await CheckpointStore(transport).latest_checkpoint()
        if step is None or step < cfg.trainer.max_steps:
            return None
        try:
            run_id = await RunStore(transport).existing_run_id(cfg.run_name)
        except ConfigError:
            return None  # another run's transport: the real start refuses it, naming it
        prefix = f"{cfg.run_name}-{run_id}"
        version = await AdapterStore(transport).latest(prefix)
        final = cfg.run_dir / FINAL_ADAPTER_DIR
        return RunResult(
            run_dir=cfg.run_dir,
            adapter_prefix=prefix,
            steps=step,
            final_version=-1 if version is None else version,
            resumed_from_step=step,
            transport_url=transport.url,
            rank=int(os.environ.get("RANK", "0")),
            adapter_dir=final if final.is_dir() else None,
            up_to_date=True,
        )


async def _evaluator(
    cfg: TrainingConfig,
    endpoint: Endpoint,
    writer: MetricsWriter,
    sync: AdapterSync,
    start: _Start,
    prefix: str,
) -> tuple[RunEvaluator | None, dict[str, float]]:
    """With an ``eval`` section: the held-out prompts read (a bad set fails before the first
    step), and the base model (version 0) evaluated unless the run resumed (its metrics)."""
    if cfg.eval is None:
        return None, {}
    evaluator = RunEvaluator(
        cfg, base_url=endpoint.url, api_key=endpoint.api_key, writer=writer, prefix=prefix
    )
    await evaluator.prepare()
    if start.resumed_from is None:
        return evaluator, await evaluator(sync.name(0), 0, step=0)
    return evaluator, {}


def _check_rollout_source(cfg: TrainingConfig, rollout_source: str) -> None:
    """Refuse a split run that would unload versions remote rollouts still use."""
    if rollout_source == "channel" and cfg.trainer.max_staleness < 1:
        raise ConfigError(
            "split runs need trainer.max_staleness >= 1: remote rollout processes learn of a new "
            "version by polling, so the previous one must stay loaded a little longer"
        )


@asynccontextmanager
async def _open_run(cfg: TrainingConfig, dp: Any) -> AsyncIterator[_Run]:
    """The run directory, the transport, and the run's identity in it.

    The run id lives in the transport (``run.json``), so a restarted run keeps its adapter names
    and continues their numbering instead of colliding with an old ``-v1``.
    """
    await anyio.Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
    transport = open_transport(run_transport_url(cfg))
    async with AsyncExitStack() as stack:
        stack.push_async_callback(transport.aclose)
        if dp is not None:
            stack.callback(dp.close)
        documents = RunStore(transport)
        run_id = await documents.run_id(cfg.run_name)
        yield _Run(
            cfg=cfg,
            transport=transport,
            documents=documents,
            run_id=run_id,
            prefix=f"{cfg.run_name}-{run_id}",
            store=AdapterStore(transport),
            checkpoints=CheckpointStore(transport, keep_last=KEEP_CHECKPOINTS),
            cache_dir=(cfg.run_dir / "adapter-cache").resolve(),
            dp=dp,
        )


@asynccontextmanager
async def _adapter_sync(
    run: _Run, endpoint: Endpoint, loader_factory: LoaderFactory | None, report: RunProgress
) -> AsyncIterator[AdapterSync]:
    """The preflight checks (the replicas agree with the trainer) and the run's LoRA slots
    booked on the proxy, then the sync that publishes each version and loads it on every
    replica through the proxy; on exit it unloads what it loaded (the store keeps them all)
    and gives the slots back."""
    cfg = run.cfg
    async with ProxyClient(
        endpoint.url, api_key=endpoint.api_key, timeout_s=endpoint.request_timeout_s
    ) as client:
        fetching = await preflight_fleet(
            cfg,
            client,
            run.transport.url,
            trainer_dtype=_trainer_dtype(cfg, run.dp),
            say=report.phase,
        )
        source: AdapterSource
        if fetching:  # replicas fetch each version themselves: nothing of this disk is needed
            source = TransportSource(run.store)
        else:
            source = LocalCacheSource(run.store, run.cache_dir)
        loader = (
            loader_factory(endpoint.url)
            if loader_factory
            else ProxyLoader(client, fetching=fetching)
        )
        sync = AdapterSync(
            store=run.store,
            source=source,
            loader=loader,
            prefix=run.prefix,
            max_staleness=cfg.trainer.max_staleness,
            base_model=cfg.model,
        )
        async with _lora_slots(cfg, client, run.prefix):
            try:
                yield sync
            finally:
                await sync.unload_all()


@asynccontextmanager
async def _lora_slots(cfg: TrainingConfig, client: ProxyClient, prefix: str) -> AsyncIterator[None]:
    """Book the LoRA slots this run keeps loaded at most (``max_staleness + 2``) on the proxy,
    which refuses, naming ``--max-loras``, a run the replicas cannot hold besides the other runs
    sharing them (and sets the run's share weight); give them back at the end. (An
    in-training evaluation books the slot of the version it pins as a run of its own.)"""
    bookings = [(prefix, cfg.trainer.max_staleness + 2, cfg.rollout.share_weight)]
    if cfg.eval is not None and cfg.serve.pinned_versions:
        bookings.append((eval_run(prefix), cfg.serve.pinned_versions, cfg.eval.share_weight))
    token = _booking_token(cfg.run_dir)
    async with AsyncExitStack() as stack:
        if cfg.proxy.admin_api_key:  # the proxy's book of runs is behind its admin key
            client = await stack.enter_async_context(
                ProxyClient(client.base_url, api_key=cfg.proxy.admin_api_key)
            )
        for name, slots, weight in bookings:
            if await client.register_run(name, lora_slots=slots, weight=weight, token=token):
                stack.push_async_callback(_release, client, name, token)
        yield


def _trainer_dtype(cfg: TrainingConfig, dp: Any) -> str | None:
    """The dtype the trainer will compute in (``trainer.dtype``, ``auto`` resolved as the
    trainer resolves it), before it loads: what the replicas' dtype must match. None (not
    compared) with FSDP over several ranks, which loads the base model elsewhere first and
    skips the served-policy audit."""
    from asyncgrpo.trainer.model import default_device, resolve_dtype

    if dp is not None and cfg.trainer.fsdp:
        return None
    device = dp.device() if dp is not None else default_device()
    return str(resolve_dtype(cfg.trainer.dtype, device)).removeprefix("torch.")


async def _release(client: ProxyClient, name: str, token: str) -> None:
    with anyio.CancelScope(shield=True), anyio.move_on_after(10):
        try:
            await client.release_run(name, token=token)
        except ReplicaError as exc:  # the proxy lets the booking lapse by itself
            logger.warning("could not give back the LoRA slots of run %s: %s", name, exc)


def _booking_token(run_dir: Path) -> str:
    """The secret that holds this run's booking on the proxy, kept in the run directory (mode
    0600) so that a restarted run can take its booking back."""
    path = Path(run_dir) / "proxy-booking-token"
    if path.exists() and len(token := path.read_text().strip()) >= 32:
        return token
    token = secrets.token_urlsafe(32)
    path.unlink(missing_ok=True)  # empty (a crash while writing it): a new one
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        f.write(token)
    return token


async def _scratch_dir(stack: AsyncExitStack, run_dir: Path) -> Path:
    """A directory in the run directory for the files on their way to the transport (each
    version's adapter, each checkpoint, a checkpoint being resumed); removed when the run ends,
    however it ends. Hidden: the run directory's listing shows the run's outputs, not its
    scratch files. One a run killed outright (SIGKILL) left is removed here: this run owns the
    directory (:func:`~asyncgrpo.run.lock.run_dir_lock`), so no other run is using it."""

    def make() -> Path:
        for left in Path(run_dir).glob(".scratch-*"):
            logger.info("removing %s, left by a run that was killed", left)
            shutil.rmtree(left, ignore_errors=True)
        return Path(tempfile.mkdtemp(prefix=".scratch-", dir=run_dir))

    work = await anyio.to_thread.run_sync(make)

    async def remove() -> None:
        # shielded: on Ctrl-C the stack unwinds in a cancelled scope, where an unshielded
        # await gives up before the thread runs (and left a .scratch-* per interruption)
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(lambda: shutil.rmtree(work, True))

    stack.push_async_callback(remove)
    return work


async def _start_trainer(run: _Run, dp: Any, work: Path, report: RunProgress) -> _Start:
    """The trainer, resumed from the newest checkpoint that verifies, if there is one (a newer
    one that does not is set aside, in one log line); under torchrun every rank resumes from
    the checkpoint rank 0 names here, once rank 0 has verified it."""
    from asyncgrpo.trainer.loop import Trainer

    cfg = run.cfg
    report.phase("loading the trainer's model")
    trainer = await anyio.to_thread.run_sync(lambda: Trainer.from_config(cfg, dp=dp))
    found = await run.checkpoints.load_latest_verified(work / "resume")
    step = None if found is None else found[1]["step"]
    if dp is not None:
        await anyio.to_thread.run_sync(dp.broadcast, {"step": step, "prefix": run.prefix})
    if found is None:
        return _Start(trainer=trainer, resumed_from=None, position=0)
    ckpt_dir, meta = found
    position = meta.get("position", 0)
    if isinstance(position, bool) or not isinstance(position, int) or position < 0:
        raise IntegrityError(
            f"checkpoint step {step}: its data position {str(position)[:40]} is not an integer >= 0"
        )
    skip = meta.get("position_skip", 0)
    if isinstance(skip, bool) or not isinstance(skip, int) or skip < 0:
        raise IntegrityError(f"checkpoint step {step}: its position_skip is not an integer >= 0")
    await anyio.to_thread.run_sync(trainer.load_checkpoint, ckpt_dir)
    logger.info("resumed from checkpoint step %d (data position %d)", step, position)
    report.phase(f"resumed from the checkpoint of step {step}")
    logged = meta.get("metrics")
    return _Start(
        trainer=trainer,
        resumed_from=step,
        position=position,
        skip=skip,
        metrics=logged if isinstance(logged, dict) else None,
    )


async def _publish_first_version(
    run: _Run, sync: AdapterSync, trainer: Any, work: Path, ledger: Ledger
) -> int:
    """Publish the starting policy as a fresh version, load it everywhere and name it in
    ``policy.json``. Fresh even on resume: a name is never reused, even after a crash, so no
    replica can serve other weights under it. Returns the version."""
    last = await run.store.latest(run.prefix)
    version = 0 if last is None else last + 1
    # A killed predecessor's versions: rollout processes still generate under its newest until
    # they read the new policy.json (unloading those failed their requests); they stay loaded
    # and retire as they age out, the older ones are unloaded before the load takes a slot.
    await sync.retire_leftovers(version)
    step = trainer.step_count
    await sync.sync(version, await _save_adapter(trainer, work / f"v{version}", version), step=step)
    ledger.published(sync.published)
    await run.documents.write_policy(sync.name(version), version)
    return version


def _served_policy_audit(run: _Run, trainer: Any, work: Path) -> ServedPolicyAudit:
    """The audit of what the replicas serve, from the versions this process saved in ``work``
    (a version published before a restart is not there, and its samples are not audited)."""

    def saved(version: int) -> Path | None:
        directory = work / f"v{version}"
        return directory if directory.is_dir() else None

    return ServedPolicyAudit(run.cfg.trainer.audit, trainer, saved, prefix=run.prefix)


def _metrics_writer(cfg: TrainingConfig, prefix: str, start: _Start | None = None) -> MetricsWriter:
    """One metrics line per logged step, to ``metrics.jsonl`` and the trackers switched on;
    the lines of steps after the checkpoint ``start`` resumed from (they are trained again)
    are dropped first, and that step's own line is written from the checkpoint if a run killed
    between the two never wrote it: each step appears once."""
    log = cfg.logging
    trackers: list[Tracker] = []
    if log.trackio:
        trackers.append(
            TrackioTracker(project=log.trackio_project, run_name=prefix, config=redacted(cfg))
        )
    if log.wandb:
        trackers.append(
            WandbTracker(
                run_dir=cfg.run_dir,
                project=log.wandb_project,
                entity=log.wandb_entity,
                run_name=prefix,
                tags=log.wandb_tags,
                config=redacted(cfg),
            )
        )
    if start is None:
        return MetricsWriter(cfg.run_dir, jsonl=log.jsonl, trackers=trackers)
    return MetricsWriter(
        cfg.run_dir,
        jsonl=log.jsonl,
        trackers=trackers,
        after_step=start.resumed_from or 0,
        restore=start.metrics,
    )


@asynccontextmanager
async def _sample_source(
    run: _Run, endpoint: Endpoint, rollout_source: str, policy: tuple[str, int], start: _Start
) -> AsyncIterator[SampleSource]:
    """Where samples come from: this process's rollout client, or remote rollout processes
    through the transport's channel, from the checkpoint's position (or the first batch: a
    trainer that died before its first checkpoint took batches its successor must train)."""
    cfg = run.cfg
    tcfg = cfg.trainer
    if rollout_source != "local":
        channel = trainer_channel(run.transport, start.trainer, cfg)
        await channel.seek(start.position)
        yield ChannelSource(channel, skip=start.skip)
        return
    # Start no rollout the trainer would drop as stale.
    window = AdmissionWindow(
        per_version=tcfg.samples_per_step * tcfg.weight_sync_steps,
        max_staleness=tcfg.max_staleness,
    )
    client = await rollout_client(
        cfg, endpoint.url, policy, start.position, api_key=endpoint.api_key, window=window
    )
    async with client:
        yield LocalSource(client)


async def _train(
    run: _Run,
    trainer: Any,
    sync: AdapterSync,
    source: SampleSource,
    writer: MetricsWriter,
    ledger: Ledger,
    work: Path,
    version: int,
    *,
    on_step: StepHook | None,
    progress: RunProgress,
    fleet: Callable[[], Awaitable[dict[str, float]]],
    audit: ServedPolicyAudit,
    evals: EvalsDuringTraining,
    state: _Progress,
) -> tuple[int, int]:
    """The loop, until ``trainer.max_steps`` or the end of the dataset: fresh samples, one
    optimizer step; every ``weight_sync_steps`` publish and load a new version, switch the
    rollouts to it, audit what the replicas served (``trainer.audit``) and start its
    evaluation if due (``eval.every``: beside the loop, never waited for); every
    ``save_steps`` a checkpoint; one metrics line. Returns (step, version).
    """
    tcfg = run.cfg.trainer

    async def switch_policy(name: str, new_version: int) -> None:
        source.set_policy(name, new_version)
        await run.documents.write_policy(name, new_version)

    step = trainer.step_count
    dropped_total = 0
    disk = LocalDisk()
    while step < tcfg.max_steps:
        t_step = time.perf_counter()
        samples, dropped = await _take_fresh(
            source, tcfg.samples_per_step, version, tcfg.max_staleness
        )
        dropped_total += len(dropped)
        wait_s = time.perf_counter() - t_step
        if not samples:
            logger.info("the dataset is exhausted after %d steps", step)
            break
        if on_step is not None and (hooked := on_step(step + 1, samples, version)) is not None:
            await hooked
        audit.observe(samples)
        metrics = await anyio.to_thread.run_sync(trainer.step, samples)
        step = trainer.step_count
        ledger.trained(step, version, samples, dropped)
        metrics.update(_sample_metrics(samples, source, version, wait_s, dropped_total))

        if step % tcfg.weight_sync_steps == 0 or disk.owes("sync"):
            new, synced = await _next_version(
                trainer, sync, work, version, step, disk, tcfg, switch_policy
            )
            if new != version:
                version = new
                metrics.update(synced)
                ledger.published(sync.published)
                metrics["adapter_version"] = float(version)
                metrics.update(await audit.after_sync())
                evals.published(version, step)

        await _checkpoint_if_due(
            run, trainer, source, work, step, version, disk, state, metrics, t_step
        )
        metrics["perf/step_s"] = time.perf_counter() - t_step
        metrics.update(await fleet())
        if step % run.cfg.logging.log_every == 0:
            writer.log(metrics, step=step)
        progress.step(step, {**metrics, **evals.shown()})
        state.step = step  # done: in metrics.jsonl, what an interruption reports
        if getattr(trainer, "stop_requested", False):  # trainer.collapse_action=stop fired
            break
    return step, version


async def _checkpoint_if_due(
    run: _Run,
    trainer: Any,
    source: SampleSource,
    work: Path,
    step: int,
    version: int,
    disk: LocalDisk,
    state: _Progress,
    metrics: dict[str, float],
    t_step: float,
) -> None:
    """A checkpoint every ``save_steps``, at the last step, and when the local disk put one
    off; it keeps the step's metrics line so far (``t_step``: when the step began)."""
    every = run.cfg.trainer.save_steps
    if not every or not (
        step % every == 0 or step == run.cfg.trainer.max_steps or disk.owes("checkpoint")
    ):
        return
    t_ckpt = time.perf_counter()
    logged = step % run.cfg.logging.log_every == 0  # kept with the checkpoint: see _checkpoint
    line = {**metrics, "perf/step_s": t_ckpt - t_step} if logged else None
    await _checkpoint(run, trainer, source, work / f"ckpt-{step}", step, version, disk, state, line)
    metrics["perf/checkpoint_s"] = time.perf_counter() - t_ckpt


def _sample_metrics(
    samples: list[Sample], source: SampleSource, version: int, wait_s: float, dropped_total: int
) -> dict[str, float]:
    """What a step's samples were: their staleness, the source's counters, the wait for them."""
    return {
        **staleness_stats(samples, current_version=version),
        **source.stats(),
        "perf/rollout_wait_s": wait_s,
        "sample/dropped_stale_total": float(dropped_total),
        "sample/rollout_queue_size": float(source.queue_size()),
        "adapter_version": float(version),
    }


async def _next_version(
    trainer: Any,
    sync: AdapterSync,
    work: Path,
    version: int,
    step: int,
    disk: LocalDisk,
    tcfg: Any,
    on_loaded: Callable[[str, int], Awaitable[None]],
) -> tuple[int, dict[str, float]]:
    """Save, publish and load the version after ``version``: the version in use then, and the
    sync's metrics. Unchanged when the disk refused the adapter (put off to the next step)."""
    adapter_dir = await disk.write(
        "sync", work / f"v{version + 1}", lambda d: _save_adapter(trainer, d, version + 1)
    )
    if adapter_dir is None:
        return version, {}
    metrics = await sync.sync(version + 1, adapter_dir, step=step, on_loaded=on_loaded)
    await _remove(work / f"v{oldest_audited(version + 1, tcfg) - 1}")
    return version + 1, metrics


async def _fleet_metrics(proxy: ProxyClient) -> dict[str, float]:
    """The proxy's fleet as ``fleet/*`` metrics (replicas in rotation, joins, rejoins, left,
    catch-ups, requests and generation seconds lost to failures); none when it does not say."""
    try:
        doc = await proxy.proxy_stats()
    except ReplicaError:
        return {}
    fleet = doc.get("fleet") if doc is not None else None
    if not isinstance(fleet, dict):
        return {}
    return {f"fleet/{k}": float(v) for k, v in fleet.items() if isinstance(v, int | float)}


async def _take_fresh(
    source: SampleSource, n: int, version: int, max_staleness: int
) -> tuple[list[Sample], list[Sample]]:
    """``n`` samples within ``max_staleness`` of ``version`` (fewer only when the source ends),
    and the staler ones dropped on the way."""
    samples: list[Sample] = []
    dropped: list[Sample] = []
    while len(samples) < n:
        got = await source.take(n - len(samples))
        if not got:
            break
        fresh, _ = filter_stale(got, current_version=version, max_staleness=max_staleness)
        kept = {id(s) for s in fresh}
        samples += fresh
        dropped += [s for s in got if id(s) not in kept]
    return samples, dropped


async def _checkpoint(
    run: _Run,
    trainer: Any,
    source: SampleSource,
    directory: Path,
    step: int,
    version: int,
    disk: LocalDisk,
    state: _Progress,
    line: dict[str, float] | None = None,
) -> None:
    """Trainer state plus the data position through the transport; then the channel may drop
    what the checkpoint covers (a resumed run continues from that position). A checkpoint the
    local disk refuses is put off to the next step (:class:`LocalDisk`). ``line``: the step's
    metrics so far, kept with it: a run killed after the checkpoint and before its metrics line
    resumes after this step, and writes the line from here."""
    meta: dict[str, Any] = {
        "version": version,
        "position": source.position(),
        "position_skip": source.skip(),
        "run_id": run.run_id,
    }
    if line is not None:
        meta["metrics"] = {
            k: v for k, v in line.items() if isinstance(v, int | float) and math.isfinite(v)
        }

    def save(path: Path) -> Path:
        return trainer.save_checkpoint(path, extra=meta)

    ckpt = await disk.write("checkpoint", directory, lambda d: anyio.to_thread.run_sync(save, d))
    if ckpt is None:
        return
    await run.checkpoints.save(step, ckpt, meta)
    state.checkpoint = step  # what a rerun resumes from, from now on
    await _remove(Path(ckpt))  # in the transport now: the local copy would pile up
    await source.committed()


class LocalDisk:
    """The trainer's writes to its own disk before a sync or a checkpoint, which a full disk
    refuses: each is put off to the next step (training goes on under the version in use; the
    last checkpoint stays the resume point), for ``DISK_PATIENCE_S`` at most, after which the
    error stops the run (a trainer that never syncs again would train on ever staler samples)."""

    def __init__(self, patience_s: float = DISK_PATIENCE_S) -> None:
        self.patience_s = patience_s
        self._failing: dict[str, float] = {}  #: what is put off -> since when

    def owes(self, what: str) -> bool:
        return what in self._failing

    async def write(
        self, what: str, directory: Path, save: Callable[[Path], Awaitable[Path]]
    ) -> Path | None:
        """``await save(directory)``, or None when the disk refused it (what it wrote is
        removed, to give the room back)."""
        try:
            path = await save(directory)
        except OSError as exc:
            if isinstance(exc, TransportError):
                raise
            await _remove(directory)
            since = self._failing.setdefault(what, time.monotonic())
            if time.monotonic() - since > self.patience_s:
                raise
            logger.warning(
                "the trainer's disk refused the %s of this step (%s): put off to the next step",
                what,
                exc,
            )
            return None
        self._failing.pop(what, None)
        return path


def oldest_audited(version: int, tcfg: Any) -> int:
    """The oldest version whose saved adapter the next audit may need: samples trained since
    the last audit (``audit.every`` syncs ago) are at most ``max_staleness`` versions older
    than the version then current. Older saved adapters are removed from the scratch
    directory after each sync, so a long run's disk holds a window of them, not every one."""
    return version - tcfg.audit.every - tcfg.max_staleness


async def _remove(path: Path) -> None:
    await anyio.to_thread.run_sync(lambda: shutil.rmtree(path, ignore_errors=True))


async def _finish(run: _Run, start: _Start, step: int, version: int) -> RunResult:
    """Release the other ranks (their :func:`~asyncgrpo.run.follower.follow` returns) and write
    ``done.json``, which ends the split run's rollout processes."""
    await anyio.to_thread.run_sync(start.trainer.release)
    await run.documents.finish(step, version)
    final = run.cfg.run_dir / FINAL_ADAPTER_DIR  # a resumed run replaces the earlier one
    await anyio.to_thread.run_sync(lambda: shutil.rmtree(final, ignore_errors=True))
    await run.store.export(run.prefix, version, final)
    return RunResult(
        run_dir=run.cfg.run_dir,
        adapter_prefix=run.prefix,
        steps=step,
        final_version=version,
        resumed_from_step=start.resumed_from,
        transport_url=run.transport.url,
        adapter_dir=final,
    )
