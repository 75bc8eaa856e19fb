"""A run's held-out evaluations: the base model before the first step, the final version
after the last (``eval`` section), through the run's endpoint."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import anyio

from asyncgrpo.evaluation.records import write_report
from asyncgrpo.evaluation.runner import eval_prompts, evaluate
from asyncgrpo.rollout.dataset import Prompt, load_tokenizer

if TYPE_CHECKING:
    from asyncgrpo.config.training import TrainingConfig
    from asyncgrpo.run.metrics import MetricsWriter

__all__ = ["RunEvaluator"]

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
