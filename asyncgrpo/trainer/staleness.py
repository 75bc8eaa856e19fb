"""Off-policy bound: samples generated too many adapter versions ago are dropped, and counted.

A sample's staleness is ``current_version - sample.version``, where ``current_version`` is the
newest adapter version the trainer has published (the one the rollout client now requests).
Staleness 0 means the sample came from the newest published policy.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

from asyncgrpo.sample import Sample

logger = logging.getLogger(__name__)


def filter_stale(
    samples: Sequence[Sample], *, current_version: int, max_staleness: int
) -> tuple[list[Sample], int]:
    """Keep samples at most ``max_staleness`` versions old; return them and how many were dropped.

    A sample from a version newer than ``current_version`` cannot exist in a healthy run (the
    trainer publishes before anyone can request it); it is kept, with a warning.
    """
    if max_staleness < 0:
        raise ValueError(f"max_staleness={max_staleness}: must be >= 0")
    kept: list[Sample] = []
    for s in samples:
        lag = current_version - s.version
        if lag < 0:
            logger.warning(
                "sample %s has version %d, newer than the trainer's %d",
                s.group_id,
                s.version,
                current_version,
            )
        if lag <= max_staleness:
            kept.append(s)
    return kept, len(samples) - len(kept)


def staleness_stats(samples: Sequence[Sample], *, current_version: int) -> dict[str, float]:
    """``sample/staleness_mean`` and ``sample/staleness_max`` (NaN for no samples)."""
    lags = [current_version - s.version for s in samples]
    if not lags:
        return {"sample/staleness_mean": math.nan, "sample/staleness_max": math.nan}
    return {
        "sample/staleness_mean": sum(lags) / len(lags),
        "sample/staleness_max": float(max(lags)),
    }
