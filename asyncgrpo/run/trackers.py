"""Experiment trackers a run's metrics are mirrored to: trackio and Weights & Biases.

``metrics.jsonl`` (:mod:`asyncgrpo.run.metrics`) is the record; a tracker is a mirror of it with
the same metric names, opened once per run and given the same ``(metrics, step)`` per logged step.
Both clients are optional installs, imported only when their tracker is switched on, so a run
without them never loads them.

Weights & Biases takes its key only from ``WANDB_API_KEY`` in the environment (the config has no
field for it, so it can never be written to a config file, a launched job's argv or a log).
Without a key it runs only in ``WANDB_MODE=offline`` (or ``disabled``): an online run without a
key would stop at an interactive login prompt, which a training job must never do.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from asyncgrpo.errors import ConfigError

__all__ = [
    "Tracker",
    "TrackioTracker",
    "WandbTracker",
    "check_wandb_key",
    "numeric",
    "require_installed",
]

#: ``WANDB_MODE`` values in which W&B needs no key (nothing leaves the machine).
WANDB_KEYLESS_MODES = frozenset({"offline", "disabled", "dryrun"})


class Tracker(Protocol):
    """A mirror of the metrics: one ``log`` per logged step, ``finish`` once at the end."""

    def log(self, metrics: Mapping[str, float], *, step: int) -> None: ...

    def finish(self) -> None: ...


def numeric(record: Mapping[str, Any]) -> dict[str, float]:
    """The finite numbers of a metrics record, without its ``step`` and ``time`` keys (the
    trackers keep their own)."""
    return {
        k: float(v)
        for k, v in record.items()
        if k not in ("step", "time")
        and isinstance(v, int | float)
        and not isinstance(v, bool)
        and math.isfinite(v)
    }


def require_installed(name: str) -> None:
    """Refuse ``logging.<name>=true`` when the tracker's client is not installed."""
    if name not in sys.modules and importlib.util.find_spec(name) is None:
        raise ConfigError(
            f"logging.{name}=true but {name} is not installed: pip install {name}, "
            f"or set logging.{name}=false"
        )


class TrackioTracker:
    """trackio, a local-first tracker with W&B's logging API."""

    def __init__(self, *, project: str | None, run_name: str | None, config: Any) -> None:
        require_installed("trackio")
        import trackio

        trackio.init(project=project or "asyncgrpo", name=run_name, config=config)
        self._client = trackio

    def log(self, metrics: Mapping[str, float], *, step: int) -> None:
        self._client.log(dict(metrics), step=step)

    def finish(self) -> None:
        self._client.finish()


def check_wandb_key(environ: Mapping[str, str] = os.environ) -> None:
    """Refuse an online W&B run without ``WANDB_API_KEY`` before anything starts."""
    mode = environ.get("WANDB_MODE", "online").strip().lower()
    if mode not in WANDB_KEYLESS_MODES and not environ.get("WANDB_API_KEY"):
        raise ConfigError(
            "logging.wandb=true needs WANDB_API_KEY in the environment "
            "(or WANDB_MODE=offline to write the run locally and `wandb sync` it later)"
        )


class WandbTracker:
    """Weights & Biases: one W&B run per asyncgrpo run, its files under ``run_dir/wandb``.

    Metrics named ``eval/*`` are also plotted against ``eval/version`` (the adapter version they
    measure), since an evaluation's answers come back steps after the version was published.
    """

    def __init__(
        self,
        *,
        run_dir: Path,
        project: str | None,
        entity: str | None,
        run_name: str | None,
        tags: Sequence[str],
        config: Any,
    ) -> None:
        check_wandb_key()
        require_installed("wandb")
        import wandb

        run_dir.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(
            project=project or "asyncgrpo",
            entity=entity,
            name=run_name,
            tags=list(tags),
            config=config,
            dir=str(run_dir),
            settings=wandb.Settings(silent=True, console="off"),
        )
        self._run.define_metric("eval/version")
        self._run.define_metric("eval/*", step_metric="eval/version")

    def log(self, metrics: Mapping[str, float], *, step: int) -> None:
        self._run.log(dict(metrics), step=step)

    def finish(self) -> None:
        self._run.finish()
