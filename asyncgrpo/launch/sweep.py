"""A sweep: one training run per point of a grid of config values, all on one fleet.

``launch.sweep`` holds entries ``KEY=V1,V2,...`` (``asyncgrpo launch CONFIG --sweep
trainer.learning_rate=1e-5,3e-5,1e-4``; several entries give every combination). Point ``i`` is
the config with its values applied, run name ``<run_name>-<i>`` and transport
``<transport>/<run_name>-<i>``: its documents, adapters and checkpoints apart from the others'.
The fleet is sized for all of them at once: ``--max-loras`` the sum of their
``max_staleness + 2`` (each run's window, load before unload) and the versions their evaluations
pin (``eval.every``), ``--max-lora-rank`` their largest
``lora.r``. What would change the fleet or a run's identity cannot be swept. Pure: no I/O.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any

from asyncgrpo.config.training import TrainingConfig
from asyncgrpo.errors import ConfigError

__all__ = ["Point", "fleet_config", "parse_sweep", "sweep_points", "under"]

#: Keys (or sections, with the dot) a point may not change: one fleet serves every point.
FIXED = ("model", "run_name", "output_dir", "transport_url", "serve.", "proxy.", "launch.")


@dataclass(frozen=True)
class Point:
    """One run of a sweep: its config and the values that make it a point (``trainer.lr=1e-5``)."""

    cfg: TrainingConfig
    label: str


def under(url: str, name: str) -> str:
    """The storage root ``name`` inside ``url`` (a query, e.g. a SAS token, kept at the end)."""
    base, mark, query = url.partition("?")
    return f"{base.rstrip('/')}/{name}{mark}{query}"


def parse_sweep(entries: list[str]) -> list[tuple[str, list[str]]]:
    """``["a.b=1,2"]`` -> ``[("a.b", ["1", "2"])]``; a malformed or fixed entry is refused."""
    axes: list[tuple[str, list[str]]] = []
    for entry in entries:
        key, sep, text = entry.partition("=")
        key = key.strip()
        values = [v.strip() for v in text.split(",")]
        if not sep or not key or not all(values):
            raise ConfigError(
                f"launch.sweep entry {entry!r}: write KEY=V1,V2,..., e.g. "
                "trainer.learning_rate=1e-5,3e-5,1e-4"
            )
        if any(key == f or (f.endswith(".") and key.startswith(f)) for f in FIXED):
            raise ConfigError(
                f"launch.sweep: {key} cannot be swept: one fleet serves every point (model, "
                "serve, proxy and launch are the fleet's; run names and storage are per point)"
            )
        if key in (k for k, _ in axes) or len(set(values)) != len(values):
            raise ConfigError(f"launch.sweep: {key} is given twice; list each key and value once")
        axes.append((key, values))
    return axes


def sweep_points(cfg: TrainingConfig, transport_url: str | None) -> list[Point]:
    """Every point of ``cfg``'s sweep, validated like any config (a bad value names its key);
    without a sweep, the one run of ``cfg``. ``transport_url``: the sweep's storage root."""
    axes = parse_sweep(list(cfg.launch.sweep))
    if not axes:
        return [Point(cfg, "")]
    base: dict[str, Any] = cfg.to_dict()
    base["launch"]["sweep"] = []
    points = []
    for i, values in enumerate(itertools.product(*(v for _, v in axes))):
        name = f"{cfg.run_name}-{i}"
        overrides = [f"{key}={value}" for (key, _), value in zip(axes, values, strict=True)]
        data = {**base, "run_name": name}
        if transport_url:
            data["transport_url"] = under(transport_url, name)
        try:
            point = TrainingConfig.from_dict(data, overrides)
        except ConfigError as exc:
            raise ConfigError(f"sweep point {i} ({' '.join(overrides)}): {exc}") from None
        points.append(Point(point, " ".join(overrides)))
    return points


def fleet_config(cfg: TrainingConfig, points: list[Point]) -> TrainingConfig:
    """``cfg`` with the replicas sized for every point at once: the largest LoRA rank and
    staleness, and LoRA slots for each run's window and evaluation."""
    if len(points) < 2:
        return cfg
    slots = sum(p.cfg.trainer.max_staleness + 2 + p.cfg.serve.pinned_versions for p in points)
    return dataclasses.replace(
        cfg,
        lora=dataclasses.replace(cfg.lora, r=max(p.cfg.lora.r for p in points)),
        trainer=dataclasses.replace(
            cfg.trainer, max_staleness=max(p.cfg.trainer.max_staleness for p in points)
        ),
        serve=dataclasses.replace(cfg.serve, max_loras=slots),
    )
