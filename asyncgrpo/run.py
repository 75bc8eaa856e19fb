"""``await run_training(cfg)``: replicas, proxy, rollout client, trainer and sync in one process.

:func:`run_training` reads as the run's phases in order, each a function or async context
manager saying why it is there: open the run (transport, run id), start or attach serving
behind the proxy, preflight checks and adapter sync, the trainer (resumed), the first version,
the sample source, the training loop, the finish. What a phase holds (transport, replicas and
proxy, loaded adapters, rollouts) sits on one exit stack, so success, an error and
cancellation all undo it in reverse order.

Under torchrun (several ranks) this function is rank 0's; the other ranks run :func:`_follow`:
they build the same trainer, resume from the checkpoint rank 0 names, and train on the shards
of each step rank 0 scatters. Only rank 0 talks to the replicas, writes the transport and logs.

Rollouts come from an in-process :class:`~asyncgrpo.rollout.RolloutClient`, or, with
``rollout_source="channel"``, from rollout processes on other machines (:func:`run_rollouts`)
through the transport's :class:`~asyncgrpo.channel.RolloutChannel`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import secrets
import statistics
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import anyio

from asyncgrpo.adapters import AdapterStore
from asyncgrpo.channel import RolloutChannel
from asyncgrpo.checkpoints import CheckpointStore
from asyncgrpo.config import TrainingConfig
from asyncgrpo.errors import AlreadyExists, ConfigError, NotFound, ReplicaError
from asyncgrpo.metrics import MetricsWriter
from asyncgrpo.proxy.server import serve_proxy
from asyncgrpo.rollout.client import RolloutClient
from asyncgrpo.rollout.dataset import PromptDataset, load_tokenizer
from asyncgrpo.rollout.window import AdmissionWindow
from asyncgrpo.sample import Sample
from asyncgrpo.serve import ServeConfig, launch_replicas
from asyncgrpo.settings import redacted
from asyncgrpo.sync import (
    AdapterLoader,
    AdapterSource,
    AdapterSync,
    LocalCacheSource,
    ProxyLoader,
    TransportSource,
    read_policy,
)
from asyncgrpo.trainer.staleness import filter_stale, staleness_stats
from asyncgrpo.transport import Transport, open_transport
from asyncgrpo.vllm_client import VLLMClient, check_adapter_fetching, check_lora_capacity

logger = logging.getLogger(__name__)

RUN_KEY = "run.json"
POLICY_KEY = "policy.json"
DONE_KEY = "done.json"
KEEP_CHECKPOINTS = 2

#: Called before each optimizer step with (step, samples, adapter version): tests use it to
#: check served logprobs against the trainer's.
StepHook = Callable[[int, Sequence[Sample], int], None]
#: Builds the adapter loader from the proxy URL (tests inject faults here).
LoaderFactory = Callable[[str], AdapterLoader]


@dataclass
class RunResult:
    run_dir: Path
    adapter_prefix: str  #: vLLM names are ``<adapter_prefix>-v<N>``
    steps: int
    final_version: int
    resumed_from_step: int | None
    transport_url: str
    rank: int = 0  #: data-parallel rank; on ranks > 0 ``final_version`` is -1 (not tracked)


async def _run_id(transport: Transport, run_name: str) -> str:
    """The run's id, created once (create-only write: two racing starts agree on one id)."""
    doc = {"run_name": run_name, "run_id": secrets.token_hex(4), "created": time.time()}
    try:
        await transport.put(RUN_KEY, json.dumps(doc).encode(), mode="create")
    except AlreadyExists:
        pass
    stored = json.loads(await transport.get(RUN_KEY))
    if stored["run_name"] != run_name:
        raise ConfigError(
            f"transport {transport.url} holds run {stored['run_name']!r}, not {run_name!r}: "
            "give each run its own transport_url (or prefix)"
        )
    return str(stored["run_id"])


def _transport_url(cfg: TrainingConfig) -> str:
    return cfg.transport_url or str((cfg.run_dir / "store").resolve())


def replica_config(cfg: TrainingConfig, transport_url: str | None = None) -> ServeConfig:
    """The settings of the replicas a run starts itself: ``serve``, with the run's log and cache
    directories, allowed to fetch adapters from the run's transport."""
    return dataclasses.replace(
        cfg.serve,
        log_dir=cfg.serve.log_dir or str(cfg.run_dir / "replica-logs"),
        transports=(transport_url or _transport_url(cfg),),
        adapter_cache_dir=cfg.serve.adapter_cache_dir or str(cfg.run_dir / "replica-adapters"),
    )


@asynccontextmanager
async def _endpoint(cfg: TrainingConfig, cache_dir: Path, transport_url: str) -> AsyncIterator[str]:
    """Local replicas (if any) plus ``proxy.upstreams``, behind an in-process proxy; yields its URL.

    Local replicas may fetch adapters from the run's transport themselves, like remote ones; the
    proxy accepts load paths only under ``cache_dir``, where the trainer fetches versions for
    replicas that share its disk.
    """
    async with AsyncExitStack() as stack:
        urls = list(cfg.proxy.upstreams)
        if cfg.serve.replicas:
            serve = replica_config(cfg, transport_url)
            replicas = await stack.enter_async_context(launch_replicas(serve))
            urls = [r.url for r in replicas] + urls
        proxy = dataclasses.replace(
            cfg.proxy,
            upstreams=tuple(urls),
            lora_roots=(*cfg.proxy.lora_roots, str(cache_dir)),
        )
        yield await stack.enter_async_context(serve_proxy(proxy))


async def _save_adapter(trainer: Any, directory: Path) -> Path:
    return await anyio.to_thread.run_sync(trainer.save_adapter, directory)


@dataclass
class _Run:
    """What the phases of one run share: its settings, its storage and its adapter names."""

    cfg: TrainingConfig
    transport: Transport
    run_id: str
    prefix: str  #: vLLM names are ``<prefix>-v<N>``
    store: AdapterStore
    checkpoints: CheckpointStore
    cache_dir: Path  #: versions fetched here for replicas that share this disk


@dataclass
class _Start:
    """The trainer and where it starts: the latest checkpoint's step and dataset position."""

    trainer: Any
    resumed_from: int | None
    position: int


async def run_training(
    cfg: TrainingConfig,
    *,
    rollout_source: Literal["local", "channel"] = "local",
    on_step: StepHook | None = None,
    loader_factory: LoaderFactory | None = None,
    progress: Callable[[int, dict[str, float]], None] | None = None,
) -> RunResult:
    """Train ``cfg`` to ``trainer.max_steps``; resumes from the latest checkpoint if any.

    One line per phase; the exit stack undoes them in reverse (rollouts stop, adapters unload,
    proxy and replicas stop, the transport closes) on success, an error and cancellation alike.
    """
    from asyncgrpo.trainer.distributed import DataParallel

    _check_rollout_source(cfg, rollout_source)
    dp = DataParallel.from_env(timeout_s=cfg.trainer.dp_timeout_s)  # None in one process
    if dp is not None and not dp.is_main:
        return await _follow(cfg, dp)
    async with AsyncExitStack() as stack:
        run = await stack.enter_async_context(_open_run(cfg, dp))
        proxy_url = await stack.enter_async_context(
            _endpoint(cfg, run.cache_dir, run.transport.url)
        )
        sync = await stack.enter_async_context(_adapter_sync(run, proxy_url, loader_factory))
        start = await _start_trainer(run, dp)
        work = Path(await anyio.to_thread.run_sync(lambda: tempfile.mkdtemp(dir=cfg.run_dir)))
        version = await _publish_first_version(run, sync, start.trainer, work)
        writer = stack.enter_context(_metrics_writer(cfg, run.prefix))
        source = await stack.enter_async_context(
            _sample_source(run, proxy_url, rollout_source, (sync.name(version), version), start)
        )
        step, version = await _train(
            run, start.trainer, sync, source, writer, work, version,
            on_step=on_step, progress=progress,
        )  # fmt: skip
        return await _finish(run, start, step, version)


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
    transport = open_transport(_transport_url(cfg))
    async with AsyncExitStack() as stack:
        stack.push_async_callback(transport.aclose)
        if dp is not None:
            stack.callback(dp.close)
        run_id = await _run_id(transport, cfg.run_name)
        yield _Run(
            cfg=cfg,
            transport=transport,
            run_id=run_id,
            prefix=f"{cfg.run_name}-{run_id}",
            store=AdapterStore(transport),
            checkpoints=CheckpointStore(transport, keep_last=KEEP_CHECKPOINTS),
            cache_dir=(cfg.run_dir / "adapter-cache").resolve(),
        )


@asynccontextmanager
async def _adapter_sync(
    run: _Run, proxy_url: str, loader_factory: LoaderFactory | None
) -> AsyncIterator[AdapterSync]:
    """The preflight checks, then the sync that publishes each version and loads it on every
    replica through the proxy; on exit it unloads what it loaded (the store keeps them all)."""
    cfg = run.cfg
    async with VLLMClient(proxy_url, api_key=cfg.proxy.api_key) as client:
        fetching = await _preflight(cfg, client, run.transport.url)
        source: AdapterSource
        if fetching:  # replicas fetch each version themselves: nothing of this disk is needed
            source = TransportSource(run.store)
        else:
            source = LocalCacheSource(run.store, run.cache_dir)
        loader = (
            loader_factory(proxy_url) if loader_factory else ProxyLoader(client, fetching=fetching)
        )
        sync = AdapterSync(
            store=run.store,
            source=source,
            loader=loader,
            prefix=run.prefix,
            max_staleness=cfg.trainer.max_staleness,
            base_model=cfg.model,
        )
        try:
            yield sync
        finally:
            await sync.unload_all()


async def _preflight(cfg: TrainingConfig, client: VLLMClient, transport_url: str) -> bool:
    """Refuse to start, before the trainer loads its model, when the served replicas cannot
    hold the run: LoRA off, a rank or slot count too small, or (when replicas fetch adapters
    themselves: ``serve.adapter_delivery``) no asyncgrpo vLLM plugin or no access to this
    run's transport. Returns whether the replicas fetch."""
    check_lora_capacity(
        await client.server_info(), lora_rank=cfg.lora.r, max_staleness=cfg.trainer.max_staleness
    )
    fetching = cfg.serve.delivery(remote_replicas=bool(cfg.proxy.upstreams)) == "fetch"
    if fetching:
        check_adapter_fetching(await client.adapter_plugin_info(), transport_url)
    return fetching


async def _start_trainer(run: _Run, dp: Any) -> _Start:
    """The trainer, resumed from the latest checkpoint if there is one; under torchrun every
    rank resumes from the checkpoint rank 0 names here."""
    from asyncgrpo.trainer.loop import Trainer

    cfg = run.cfg
    trainer = await anyio.to_thread.run_sync(lambda: Trainer.from_config(cfg, dp=dp))
    latest = await run.checkpoints.latest_checkpoint()
    if dp is not None:
        await anyio.to_thread.run_sync(dp.broadcast, {"step": latest, "prefix": run.prefix})
    if latest is None:
        return _Start(trainer=trainer, resumed_from=None, position=0)
    dest = cfg.run_dir / "resume" / f"step-{latest}"
    ckpt_dir, meta = await run.checkpoints.load(latest, dest)
    await anyio.to_thread.run_sync(trainer.load_checkpoint, ckpt_dir)
    position = int(meta.get("position", 0))
    logger.info("resumed from checkpoint step %d (data position %d)", latest, position)
    return _Start(trainer=trainer, resumed_from=latest, position=position)


async def _publish_first_version(run: _Run, sync: AdapterSync, trainer: Any, work: Path) -> int:
    """Publish the starting policy as a fresh version, load it everywhere and name it in
    ``policy.json``. Fresh even on resume: a name is never reused, even after a crash, so no
    replica can serve other weights under it. Returns the version."""
    last = await run.store.latest(run.prefix)
    version = 0 if last is None else last + 1
    await sync.retire_leftovers()
    step = trainer.step_count
    await sync.sync(version, await _save_adapter(trainer, work / f"v{version}"), step=step)
    await run.transport.put(POLICY_KEY, _policy_doc(sync.name(version), version))
    return version


def _metrics_writer(cfg: TrainingConfig, prefix: str) -> MetricsWriter:
    """One metrics line per logged step, to ``metrics.jsonl`` and (optionally) trackio."""
    return MetricsWriter(
        cfg.run_dir,
        jsonl=cfg.logging.jsonl,
        trackio=cfg.logging.trackio,
        project=cfg.logging.trackio_project,
        run_name=prefix,
        config=redacted(cfg),
    )


@asynccontextmanager
async def _sample_source(
    run: _Run, proxy_url: str, rollout_source: str, policy: tuple[str, int], start: _Start
) -> AsyncIterator[_SampleSource]:
    """Where samples come from: this process's rollout client, or remote rollout processes
    through the transport's channel (continued from the checkpoint's position on resume)."""
    cfg = run.cfg
    tcfg = cfg.trainer
    if rollout_source != "local":
        channel = RolloutChannel(run.transport)
        if start.resumed_from is not None:
            await channel.seek(start.position)
        yield _ChannelSource(channel)
        return
    # Start no rollout the trainer would drop as stale.
    window = AdmissionWindow(
        per_version=tcfg.samples_per_step * tcfg.weight_sync_steps,
        max_staleness=tcfg.max_staleness,
    )
    client = await _rollout_client(cfg, proxy_url, policy, start.position, window=window)
    async with client:
        yield _LocalSource(client)


async def _train(
    run: _Run,
    trainer: Any,
    sync: AdapterSync,
    source: _SampleSource,
    writer: MetricsWriter,
    work: Path,
    version: int,
    *,
    on_step: StepHook | None,
    progress: Callable[[int, dict[str, float]], None] | None,
) -> tuple[int, int]:
    """The loop, until ``trainer.max_steps`` or the end of the dataset: fresh samples, one
    optimizer step; every ``weight_sync_steps`` publish and load a new version and switch the
    rollouts to it; every ``save_steps`` a checkpoint; one metrics line. Returns (step, version).
    """
    tcfg = run.cfg.trainer

    async def switch_policy(name: str, new_version: int) -> None:
        source.set_policy(name, new_version)
        await run.transport.put(POLICY_KEY, _policy_doc(name, new_version))

    step = trainer.step_count
    dropped_total = 0
    while step < tcfg.max_steps:
        t_step = time.perf_counter()
        samples, dropped = await _take_fresh(
            source, tcfg.samples_per_step, version, tcfg.max_staleness
        )
        dropped_total += dropped
        wait_s = time.perf_counter() - t_step
        if not samples:
            logger.info("the dataset is exhausted after %d steps", step)
            break
        if on_step is not None:
            on_step(step + 1, samples, version)
        metrics = await anyio.to_thread.run_sync(trainer.step, samples)
        step = trainer.step_count
        metrics.update(staleness_stats(samples, current_version=version))
        metrics.update(source.stats())
        metrics["perf/rollout_wait_s"] = wait_s
        metrics["sample/dropped_stale_total"] = float(dropped_total)
        metrics["sample/rollout_queue_size"] = float(source.queue_size())
        metrics["adapter_version"] = float(version)

        if step % tcfg.weight_sync_steps == 0:
            version += 1
            adapter_dir = await _save_adapter(trainer, work / f"v{version}")
            metrics.update(
                await sync.sync(version, adapter_dir, step=step, on_loaded=switch_policy)
            )
            metrics["adapter_version"] = float(version)

        if tcfg.save_steps and (step % tcfg.save_steps == 0 or step == tcfg.max_steps):
            t_ckpt = time.perf_counter()
            await _checkpoint(run, trainer, source, work / f"ckpt-{step}", step, version)
            metrics["perf/checkpoint_s"] = time.perf_counter() - t_ckpt

        metrics["perf/step_s"] = time.perf_counter() - t_step
        if step % run.cfg.logging.log_every == 0:
            writer.log(metrics, step=step)
        if progress is not None:
            progress(step, metrics)
    return step, version


async def _take_fresh(
    source: _SampleSource, n: int, version: int, max_staleness: int
) -> tuple[list[Sample], int]:
    """``n`` samples within ``max_staleness`` of ``version`` (fewer only when the source ends),
    and how many staler ones were dropped on the way."""
    samples: list[Sample] = []
    dropped_total = 0
    while len(samples) < n:
        got = await source.take(n - len(samples))
        if not got:
            break
        fresh, dropped = filter_stale(got, current_version=version, max_staleness=max_staleness)
        samples += fresh
        dropped_total += dropped
    return samples, dropped_total


async def _checkpoint(
    run: _Run, trainer: Any, source: _SampleSource, directory: Path, step: int, version: int
) -> None:
    """Trainer state plus the data position through the transport; then the channel may drop
    what the checkpoint covers (a resumed run continues from that position)."""
    meta = {"version": version, "position": source.position(), "run_id": run.run_id}
    ckpt = await anyio.to_thread.run_sync(lambda: trainer.save_checkpoint(directory, extra=meta))
    await run.checkpoints.save(step, ckpt, meta)
    await source.committed()


async def _finish(run: _Run, start: _Start, step: int, version: int) -> RunResult:
    """Release the other ranks (their :func:`_follow` returns) and write ``done.json``, which
    ends the split run's rollout processes."""
    await anyio.to_thread.run_sync(start.trainer.release)
    await run.transport.put(DONE_KEY, json.dumps({"step": step, "version": version}).encode())
    return RunResult(
        run_dir=run.cfg.run_dir,
        adapter_prefix=run.prefix,
        steps=step,
        final_version=version,
        resumed_from_step=start.resumed_from,
        transport_url=run.transport.url,
    )


async def _follow(cfg: TrainingConfig, dp: Any) -> RunResult:
    """A data-parallel rank other than 0: the same trainer, resumed from the checkpoint rank 0
    names, training on the shards rank 0 scatters until rank 0 releases it.

    It reads the transport (the checkpoint) and never writes it; nothing here logs metrics.
    """
    from asyncgrpo.trainer.loop import Trainer

    try:
        trainer = await anyio.to_thread.run_sync(lambda: Trainer.from_config(cfg, dp=dp))
        start = await anyio.to_thread.run_sync(dp.broadcast, None)
        url = _transport_url(cfg)
        if start["step"] is not None:
            async with open_transport(url) as transport:
                dest = cfg.run_dir / "resume" / f"rank-{dp.rank}"
                ckpt_dir, _ = await CheckpointStore(transport).load(start["step"], dest)
            await anyio.to_thread.run_sync(trainer.load_checkpoint, ckpt_dir)
        await anyio.to_thread.run_sync(trainer.follow)
    finally:
        dp.close()
    return RunResult(
        run_dir=cfg.run_dir,
        adapter_prefix=start["prefix"],
        steps=trainer.step_count,
        final_version=-1,
        resumed_from_step=start["step"],
        transport_url=url,
        rank=dp.rank,
    )


async def _rollout_client(
    cfg: TrainingConfig,
    base_url: str,
    policy: tuple[str, int],
    position: int,
    window: AdmissionWindow | None = None,
) -> RolloutClient:
    """The rollout client of a run: the dataset with the model's chat template, via the proxy.

    ``window``: in the trainer's process, start no rollout the trainer would drop as stale (a
    remote client cannot see what the trainer has read, and relies on the queue bound).
    """
    tokenizer = await anyio.to_thread.run_sync(load_tokenizer, cfg.model)
    return RolloutClient(
        base_url=base_url,
        dataset=PromptDataset.from_config(cfg.dataset, tokenizer=tokenizer),
        generation=cfg.generation,
        rollout=cfg.rollout,
        policy=policy,
        start_position=position,
        api_key=cfg.proxy.api_key,
        window=window,
    )


def _policy_doc(name: str, version: int) -> bytes:
    return json.dumps({"adapter": name, "version": version, "time": time.time()}).encode()


class _SampleSource:
    async def take(self, n: int) -> list[Sample]: ...
    def set_policy(self, name: str, version: int) -> None: ...
    def position(self) -> int: ...
    async def committed(self) -> None: ...
    def stats(self) -> dict[str, float]: ...
    def queue_size(self) -> int: ...


class _LocalSource(_SampleSource):
    def __init__(self, client: RolloutClient) -> None:
        self.client = client

    async def take(self, n: int) -> list[Sample]:
        return await self.client.get(n)

    def set_policy(self, name: str, version: int) -> None:
        self.client.set_policy(name, version)

    def position(self) -> int:
        return self.client.position

    async def committed(self) -> None:
        pass

    def stats(self) -> dict[str, float]:
        return self.client.stats()

    def queue_size(self) -> int:
        return self.client.queue_size


class _ChannelSource(_SampleSource):
    """Samples shipped by remote rollout processes; the policy travels as ``policy.json``."""

    def __init__(self, channel: RolloutChannel) -> None:
        self.channel = channel
        self.buffer: list[Sample] = []

    async def take(self, n: int) -> list[Sample]:
        while not self.buffer:
            batch = await self.channel.receive()
            self.buffer = list(batch.samples)
        out, self.buffer = self.buffer[:n], self.buffer[n:]
        return out

    def set_policy(self, name: str, version: int) -> None:
        pass  # the trainer writes policy.json; rollout processes poll it

    def position(self) -> int:
        return self.channel.position or 0

    async def committed(self) -> None:
        await self.channel.commit()

    def stats(self) -> dict[str, float]:
        return {"rollout/quarantined_batches": float(self.channel.quarantined)}

    def queue_size(self) -> int:
        return len(self.buffer)


async def run_rollouts(cfg: TrainingConfig, *, poll_interval_s: float = 0.5) -> int:
    """A rollout process for a split run: generate under the trainer's current policy and ship
    scored samples through the transport until the trainer writes ``done.json``.

    Uses ``proxy.upstreams`` (or local replicas) behind its own in-process proxy. Returns the number
    of samples shipped.
    """
    transport = open_transport(_transport_url(cfg))
    shipped = [0]
    try:
        await _ship_rollouts(cfg, transport, poll_interval_s, shipped)
    except ReplicaError:
        # The trainer unloads its adapters right after writing done.json; requests still in
        # flight under them answer 404 before the next poll sees the end. That is the end too.
        if not await transport.exists(DONE_KEY):
            raise
        logger.info("the trainer finished while rollouts were in flight; stopping")
    finally:
        await transport.aclose()
    return shipped[0]


async def _ship_rollouts(
    cfg: TrainingConfig, transport: Transport, poll_interval_s: float, shipped: list[int]
) -> None:
    async with AsyncExitStack() as stack:
        policy = await _wait_for(transport, POLICY_KEY, poll_interval_s)
        name, version = read_policy(policy)
        proxy_url = await stack.enter_async_context(
            _endpoint(cfg, cfg.run_dir / "adapter-cache", transport.url)
        )
        channel = RolloutChannel(transport)
        client = await stack.enter_async_context(
            await _rollout_client(cfg, proxy_url, (name, version), 0)
        )
        async with anyio.create_task_group() as tg:

            async def follow_policy() -> None:
                while True:
                    await anyio.sleep(poll_interval_s)
                    if await transport.exists(DONE_KEY):
                        tg.cancel_scope.cancel()
                        return
                    new_name, new_version = read_policy(await transport.get(POLICY_KEY))
                    if new_version > client.policy[1]:
                        client.set_policy(new_name, new_version)

            tg.start_soon(follow_policy)
            group = cfg.generation.num_generations
            while True:
                samples = await client.get(group)
                if not samples:
                    break
                await channel.append(samples)
                shipped[0] += len(samples)
            tg.cancel_scope.cancel()


async def _wait_for(transport: Transport, key: str, poll_interval_s: float) -> bytes:
    while True:
        try:
            return await transport.get(key)
        except NotFound:
            await anyio.sleep(poll_interval_s)


def summarize(records: Sequence[dict[str, Any]], key: str, first: int = 5) -> tuple[float, float]:
    """Mean of ``key`` over the first and the last ``first`` steps (NaN-skipping)."""
    values = [
        r[key] for r in records if isinstance(r.get(key), int | float) and not math.isnan(r[key])
    ]
    if not values:
        return math.nan, math.nan
    n = min(first, len(values))
    return statistics.fmean(values[:n]), statistics.fmean(values[-n:])
