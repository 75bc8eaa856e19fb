"""The served-policy audit in a run (``trainer.audit``): the trainer's forward, metrics, the stop.

The run hands every trained step's samples to :meth:`ServedPolicyAudit.observe` and calls
:meth:`ServedPolicyAudit.after_sync` after each weight sync: every ``trainer.audit.every``
syncs, a few of the samples trained since the last audit (spread over the replicas that served
them: :mod:`asyncgrpo.trainer.audit`) are recomputed at the version that sampled them, from the
adapter the run saved before publishing that version, and compared with vLLM's logprobs. Above
the tolerance it raises :class:`~asyncgrpo.errors.AuditError` (``action=stop``, one line naming
the version, the replica and the difference) or logs that line (``action=warn``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import anyio

from asyncgrpo.config.trainer import AuditConfig
from asyncgrpo.errors import AuditError
from asyncgrpo.sample import Sample
from asyncgrpo.trainer.audit import AuditTally, RecentSamples, by_version

__all__ = ["ServedPolicyAudit"]

logger = logging.getLogger(__name__)


class ServedPolicyAudit:
    """Audits the served policy after weight syncs; ``adapter_dir(version)`` is where the run
    saved that version (None: not on this disk, e.g. published before a restart: skipped)."""

    def __init__(
        self,
        config: AuditConfig,
        trainer: Any,
        adapter_dir: Callable[[int], Path | None],
        *,
        prefix: str = "",
    ) -> None:
        self.config = config
        self.trainer = trainer
        self.adapter_dir = adapter_dir
        self.prefix = prefix
        self.enabled = config.action != "off"
        dp = getattr(trainer, "dp", None)
        if self.enabled and dp is not None and trainer.config.fsdp:
            # A forward with sharded weights needs every rank, which sit in their own loop.
            logger.info("trainer.audit is skipped with trainer.fsdp over several ranks")
            self.enabled = False
        self.recent = RecentSamples(per_replica=config.samples)
        self.syncs = 0
        self.dtype = getattr(trainer, "dtype_name", "float32")
        self.tolerance = config.tolerance_for(self.dtype)

    def observe(self, samples: Sequence[Sample]) -> None:
        """Samples the trainer trained on (candidates for the next audit)."""
        if self.enabled:
            self.recent.add(samples)

    async def after_sync(self) -> dict[str, float]:
        """Audit now if this sync is one of every ``every``: the ``audit/*`` metrics (none when
        nothing was audited); raises :class:`AuditError` above the tolerance with action stop."""
        self.syncs += 1
        if not self.enabled or self.syncs % self.config.every:
            return {}
        picked = self.recent.take(self.config.samples)
        if not picked:
            return {}
        t0 = time.perf_counter()
        tally = await anyio.to_thread.run_sync(self.recompute, picked)
        metrics = tally.metrics()
        if metrics:
            metrics["perf/audit_s"] = time.perf_counter() - t0
        line = tally.verdict(self.tolerance, prefix=self.prefix, dtype=self.dtype)
        if line is not None:
            if self.config.action == "stop":
                raise AuditError(f"{line}; stopping the run (trainer.audit.action=stop)")
            logger.warning("%s (trainer.audit.action=warn: training on)", line)
        return metrics

    def recompute(self, samples: Sequence[Sample]) -> AuditTally:
        """The trainer's logprobs of ``samples`` at each of their versions, compared (blocking:
        one forward per version present)."""
        tally = AuditTally()
        for version, group in by_version(samples).items():
            directory = self.adapter_dir(version)
            if directory is None:
                logger.debug("audit: version %d is not on this disk; skipped", version)
                continue
            ours = self.trainer.logprobs_at(group, directory)
            for sample, recomputed in zip(group, ours, strict=True):
                tally.add(sample, version, recomputed)
        return tally
