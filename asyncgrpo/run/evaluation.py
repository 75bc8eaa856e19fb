"""A run's held-out evaluations (``eval`` section): the base model before the first step, every
``eval.every`` published versions while training goes on, and the final version after the
last, through the run's endpoint; and ``asyncgrpo eval``: any published version of a run,
finished or running, on its fleet or on replicas started for it.

An evaluation during training runs beside the trainer, which never waits for it. It pins the
version it names (:meth:`~asyncgrpo.run.sync.AdapterSync.pin`: loaded until the evaluation
ends, even once it has left the staleness window; the run's eval booking on the proxy holds
that slot) and its requests count for a proxy run of its own (:func:`eval_run`, with
``eval.share_weight``), so the fair share bounds what it takes from training's generation.
One runs at a time: a version that falls due while one runs is skipped, not queued, so at
most one version is pinned and the fleet never falls behind on evaluations.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import anyio

from asyncgrpo.errors import ConfigError
from asyncgrpo.evaluation.records import write_report
from asyncgrpo.evaluation.runner import eval_prompts, eval_run, evaluate
from asyncgrpo.rollout.dataset import Prompt, load_tokenizer

if TYPE_CHECKING:
    from asyncgrpo.config.training import TrainingConfig
    from asyncgrpo.run.metrics import MetricsWriter
    from asyncgrpo.run.progress import RunProgress
    from asyncgrpo.run.sync import AdapterSync

__all__ = [
    "EvalsDuringTraining",
    "RunEvaluator",
    "evals_during_training",
    "evaluate_published",
    "pick_versions",
]

logger = logging.getLogger(__name__)


class RunEvaluator:
    """Evaluates served versions of one run and keeps the results in its run directory."""

    def __init__(
        self,
        cfg: TrainingConfig,
        *,
        base_url: str,
        api_key: str | None,
        writer: MetricsWriter,
        prefix: str,
    ) -> None:
        self.cfg = cfg
        self.base_url = base_url
        self.api_key = api_key
        self.writer = writer
        self.run = eval_run(prefix)  #: the proxy run its requests count for
        self._tokenizer: Any = None
        self._prompts: list[Prompt] | None = None

    async def prepare(self) -> int:
        """Read and tokenize the held-out prompts (a bad set fails here, before training);
        returns how many there are."""
        if self._prompts is None:
            self._tokenizer = await anyio.to_thread.run_sync(load_tokenizer, self.cfg.model)
            self._prompts = await anyio.to_thread.run_sync(eval_prompts, self.cfg, self._tokenizer)
        return len(self._prompts)

    async def __call__(
        self,
        model: str,
        version: int,
        *,
        step: int,
        on_graded: Callable[[int, int], None] | None = None,
    ) -> dict[str, float]:
        """Evaluate ``model`` (adapter ``version``), record it, and return its metrics;
        ``on_graded(done, total)`` hears of each prompt graded."""
        await self.prepare()
        assert self._prompts is not None
        report = await evaluate(
            self.cfg,
            base_url=self.base_url,
            api_key=self.api_key,
            model=model,
            version=version,
            prompts=self._prompts,
            tokenizer=self._tokenizer,
            run=self.run,
            on_graded=on_graded,
        )
        await anyio.to_thread.run_sync(lambda: write_report(self.cfg.run_dir, report, step=step))
        self.writer.mirror(report.metrics, step=step)
        m = report.metrics
        logger.info(
            "eval of version %d: reward %.3f, pass@1 %.3f over %d prompts in %.1f s",
            version,
            m["eval/reward"],
            m.get("eval/pass@1", float("nan")),
            int(m["eval/prompts"]),
            m["eval/seconds"],
        )
        return report.metrics


class EvalsDuringTraining:
    """Starts an evaluation of every ``every``-th published version beside the trainer, one at
    a time (a version falling due while one runs is skipped); then the final version's."""

    def __init__(
        self, evaluator: RunEvaluator | None, sync: AdapterSync, every: int, tg: Any
    ) -> None:
        self.evaluator = evaluator
        self.sync = sync
        self.every = every if evaluator is not None else 0
        self._tg = tg
        self._running: int | None = None
        self._idle = anyio.Event()
        self._idle.set()
        self.evaluated: list[int] = []  #: versions evaluated during training, in order
        self.skipped: list[int] = []  #: versions that fell due while another was evaluated
        self.latest: dict[str, float] = {}  #: the last evaluation's metrics

    def published(self, version: int, step: int) -> None:
        """``version`` is loaded everywhere (call right after its sync, before the next one):
        start its evaluation if it is due and none runs."""
        if not self.every or version % self.every:
            return
        if self._running is not None:
            self.skipped.append(version)
            logger.info(
                "eval of version %d skipped: version %d is still being evaluated",
                version,
                self._running,
            )
            return
        name = self.sync.pin(version)  # now: the next sync may not retire it
        self._running, self._idle = version, anyio.Event()
        self._tg.start_soon(self._evaluate, name, version, step)

    async def _evaluate(self, name: str, version: int, step: int) -> None:
        assert self.evaluator is not None
        try:
            self.latest = await self.evaluator(name, version, step=step)
            self.evaluated.append(version)
        except Exception as exc:  # an evaluation never stops the trainer
            logger.warning("eval of version %d failed (training goes on): %s", version, exc)
        finally:
            await self.sync.unpin(version)
            self._running = None
            self._idle.set()

    def shown(self) -> dict[str, float]:
        """The last evaluation, for the progress line: its version and reward."""
        keys = ("eval/version", "eval/reward", "eval/pass@1")
        return {k: v for k in keys if math.isfinite(v := self.latest.get(k, math.nan))}

    async def finish(self, version: int, step: int) -> None:
        """After the last step: wait for the evaluation in flight, then evaluate the final
        ``version`` unless that was the one."""
        await self._idle.wait()
        if self.evaluator is not None and version not in self.evaluated:
            self.latest = await self.evaluator(self.sync.name(version), version, step=step)


@asynccontextmanager
async def evals_during_training(
    evaluator: RunEvaluator | None, sync: AdapterSync, every: int
) -> AsyncIterator[EvalsDuringTraining]:
    """The evaluations of a training loop; an error in the loop cancels the one in flight (its
    version unpinned)."""
    async with anyio.create_task_group() as tg:
        yield EvalsDuringTraining(evaluator, sync, every, tg)


def pick_versions(
    published: list[int], *, version: int | None, base: bool, every: bool
) -> list[int]:
    """The versions ``asyncgrpo eval`` evaluates: ``--all``, ``--base`` (0), ``--version N``,
    or the newest; ``ConfigError`` naming what is published when one is not."""
    if not published:
        raise ConfigError("the run has published no adapter version yet")
    if every:
        return list(published)
    wanted = 0 if base else published[-1] if version is None else version
    if wanted not in published:
        from asyncgrpo.store.adapters import describe_versions

        raise ConfigError(
            f"version {wanted} is not published (published versions: "
            f"{describe_versions(published)})"
        )
    return [wanted]


async def evaluate_published(
    cfg: TrainingConfig,
    *,
    version: int | None = None,
    base: bool = False,
    every: bool = False,
    progress: RunProgress | None = None,
) -> list[dict[str, float]]:
    """Evaluate published versions of ``cfg``'s run: each is loaded on the fleet unless it is
    served already (a running run's window), evaluated, and unloaded again if it was loaded
    here; results go to the run directory like a run's own evaluations. ``progress`` hears
    the phases (replicas starting, each version loaded) and how many prompts are graded."""
    from asyncgrpo.config.training import run_transport_url
    from asyncgrpo.run.endpoint import open_endpoint
    from asyncgrpo.run.metrics import MetricsWriter
    from asyncgrpo.run.preflight import dry_run, preflight_fleet
    from asyncgrpo.run.progress import Silent
    from asyncgrpo.run.sync import LocalCacheSource, ProxyLoader, TransportSource
    from asyncgrpo.store.adapters import AdapterStore
    from asyncgrpo.store.run_documents import RunStore, open_run_transport
    from asyncgrpo.vllm.api import served_name
    from asyncgrpo.vllm.client import VLLMClient

    report = progress or Silent()
    await anyio.to_thread.run_sync(dry_run, cfg)  # the held-out rows, the rewards: first
    url = run_transport_url(cfg)
    # a path is read, never made: evaluating a run that never started leaves no directory
    transport = open_run_transport(url)
    if transport is None:
        raise ConfigError(
            f"no run has started in {url} (there is no such directory): train first, or give "
            "the config of the run to evaluate"
        )
    async with transport:
        prefix = f"{cfg.run_name}-{await RunStore(transport).existing_run_id(cfg.run_name)}"
        store = AdapterStore(transport)
        chosen = pick_versions(
            await store.versions(prefix), version=version, base=base, every=every
        )
        cache = (cfg.run_dir / "adapter-cache").resolve()
        async with (
            open_endpoint(cfg, cache, transport.url, phase=report.phase) as endpoint,
            VLLMClient(
                endpoint.url, api_key=endpoint.api_key, timeout_s=endpoint.request_timeout_s
            ) as client,
        ):
            fetching = await preflight_fleet(cfg, client, transport.url)
            source = TransportSource(store) if fetching else LocalCacheSource(store, cache)
            loader = ProxyLoader(client, fetching=fetching)
            with MetricsWriter(cfg.run_dir, jsonl=False) as writer:
                evaluator = RunEvaluator(
                    cfg,
                    base_url=endpoint.url,
                    api_key=endpoint.api_key,
                    writer=writer,
                    prefix=prefix,
                )
                results = []
                for v in chosen:
                    name = served_name(prefix, v)
                    loaded_here = name not in await loader.loaded()
                    if loaded_here:
                        await loader.load(name, await source.locate(prefix, v))
                    report.phase(f"evaluating version {v} ({name})")
                    try:
                        results.append(
                            await evaluator(name, v, step=-1, on_graded=_graded_lines(report, v))
                        )
                    finally:
                        if loaded_here:
                            with anyio.CancelScope(shield=True):
                                await loader.unload(name)
    return results


#: Seconds between two progress lines of an evaluation.
GRADED_EVERY_S = 5.0


def _graded_lines(report: RunProgress, version: int) -> Callable[[int, int], None]:
    """``on_graded`` for ``asyncgrpo eval``: a line at most every :data:`GRADED_EVERY_S`,
    and the last."""
    last = time.monotonic()

    def on_graded(done: int, total: int) -> None:
        nonlocal last
        if done == total or time.monotonic() - last >= GRADED_EVERY_S:
            last = time.monotonic()
            report.phase(f"version {version}: {done}/{total} prompts graded")

    return on_graded
