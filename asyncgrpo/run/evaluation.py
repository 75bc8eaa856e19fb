"""A run's held-out evaluations (``eval`` section): the base model before the first step and
the final version after the last, through the run's endpoint; and ``asyncgrpo eval``: any
published version of a run, finished or running, on its fleet or on replicas started for it."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import anyio

from asyncgrpo.errors import ConfigError
from asyncgrpo.evaluation.records import write_report
from asyncgrpo.evaluation.runner import eval_prompts, evaluate
from asyncgrpo.rollout.dataset import Prompt, load_tokenizer

if TYPE_CHECKING:
    from asyncgrpo.config.training import TrainingConfig
    from asyncgrpo.run.metrics import MetricsWriter

__all__ = ["RunEvaluator", "evaluate_published", "pick_versions"]

logger = logging.getLogger(__name__)


class RunEvaluator:
    """Evaluates served versions of one run and keeps the results in its run directory."""

    def __init__(
        self, cfg: TrainingConfig, *, base_url: str, api_key: str | None, writer: MetricsWriter
    ) -> None:
        self.cfg = cfg
        self.base_url = base_url
        self.api_key = api_key
        self.writer = writer
        self._tokenizer: Any = None
        self._prompts: list[Prompt] | None = None

    async def prepare(self) -> int:
        """Read and tokenize the held-out prompts (a bad set fails here, before training);
        returns how many there are."""
        if self._prompts is None:
            self._tokenizer = await anyio.to_thread.run_sync(load_tokenizer, self.cfg.model)
            self._prompts = await anyio.to_thread.run_sync(eval_prompts, self.cfg, self._tokenizer)
        return len(self._prompts)

    async def __call__(self, model: str, version: int, *, step: int) -> dict[str, float]:
        """Evaluate ``model`` (adapter ``version``), record it, and return its metrics."""
        await self.prepare()
        assert self._prompts is not None
        report = await evaluate(
            self.cfg, base_url=self.base_url, api_key=self.api_key, model=model,
            version=version, prompts=self._prompts, tokenizer=self._tokenizer,
        )  # fmt: skip
        await anyio.to_thread.run_sync(lambda: write_report(self.cfg.run_dir, report, step=step))
        self.writer.mirror(report.metrics, step=step)
        m = report.metrics
        logger.info(
            "eval of version %d: reward %.3f, pass@1 %.3f over %d prompts in %.1f s",
            version, m["eval/reward"], m.get("eval/pass@1", float("nan")),
            int(m["eval/prompts"]), m["eval/seconds"],
        )  # fmt: skip
        return report.metrics


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
        shown = ", ".join(map(str, published[-10:]))
        raise ConfigError(f"version {wanted} is not published (published versions: {shown})")
    return [wanted]


async def evaluate_published(
    cfg: TrainingConfig, *, version: int | None = None, base: bool = False, every: bool = False
) -> list[dict[str, float]]:
    """Evaluate published versions of ``cfg``'s run: each is loaded on the fleet unless it is
    served already (a running run's window), evaluated, and unloaded again if it was loaded
    here; results go to the run directory like a run's own evaluations."""
    from asyncgrpo.config.training import run_transport_url
    from asyncgrpo.run.endpoint import open_endpoint
    from asyncgrpo.run.metrics import MetricsWriter
    from asyncgrpo.run.preflight import preflight_fleet
    from asyncgrpo.run.sync import LocalCacheSource, ProxyLoader, TransportSource
    from asyncgrpo.store.adapters import AdapterStore
    from asyncgrpo.store.run_documents import RunStore
    from asyncgrpo.transport import open_transport
    from asyncgrpo.vllm.api import served_name
    from asyncgrpo.vllm.client import VLLMClient

    url = run_transport_url(cfg)
    local = "://" not in url or url.startswith("file://")
    try:  # a path is read, never made: evaluating a run that never started leaves no directory
        transport = open_transport(url, **({"create": False} if local else {}))
    except ConfigError:
        raise ConfigError(
            f"no run has started in {url} (there is no such directory): train first, or give "
            "the config of the run to evaluate"
        ) from None
    async with transport:
        prefix = f"{cfg.run_name}-{await RunStore(transport).existing_run_id(cfg.run_name)}"
        store = AdapterStore(transport)
        chosen = pick_versions(
            await store.versions(prefix), version=version, base=base, every=every
        )
        cache = (cfg.run_dir / "adapter-cache").resolve()
        async with (
            open_endpoint(cfg, cache, transport.url) as endpoint,
            VLLMClient(endpoint.url, api_key=endpoint.api_key) as client,
        ):
            fetching = await preflight_fleet(cfg, client, transport.url)
            source = TransportSource(store) if fetching else LocalCacheSource(store, cache)
            loader = ProxyLoader(client, fetching=fetching)
            with MetricsWriter(cfg.run_dir, jsonl=False) as writer:
                evaluator = RunEvaluator(
                    cfg, base_url=endpoint.url, api_key=endpoint.api_key, writer=writer
                )
                results = []
                for v in chosen:
                    name = served_name(prefix, v)
                    loaded_here = name not in await loader.loaded()
                    if loaded_here:
                        await loader.load(name, await source.locate(prefix, v))
                    try:
                        results.append(await evaluator(name, v, step=-1))
                    finally:
                        if loaded_here:
                            with anyio.CancelScope(shield=True):
                                await loader.unload(name)
    return results
