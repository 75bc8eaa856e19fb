"""Staleness filter against a plain count."""

from __future__ import annotations

import math

import pytest
from trainer_helpers import make_samples

from asyncgrpo.trainer.staleness import filter_stale, staleness_stats


def test_filter_stale_keeps_recent_and_counts_dropped():
    samples = make_samples(10)
    for i, s in enumerate(samples):
        s.version = i  # versions 0..9
    kept, dropped = filter_stale(samples, current_version=9, max_staleness=4)
    assert [s.version for s in kept] == [5, 6, 7, 8, 9]
    assert dropped == 5
    kept, dropped = filter_stale(samples, current_version=9, max_staleness=0)
    assert [s.version for s in kept] == [9] and dropped == 9
    stats = staleness_stats(kept, current_version=9)
    assert stats == {"sample/staleness_mean": 0.0, "sample/staleness_max": 0.0}


def test_staleness_stats_and_future_versions(caplog):
    samples = make_samples(3)
    for s, v in zip(samples, [1, 3, 6], strict=True):
        s.version = v
    stats = staleness_stats(samples, current_version=5)
    assert stats["sample/staleness_mean"] == pytest.approx((4 + 2 - 1) / 3)
    assert stats["sample/staleness_max"] == 4
    kept, dropped = filter_stale(samples, current_version=5, max_staleness=2)
    assert [s.version for s in kept] == [3, 6] and dropped == 1
    assert "newer than" in caplog.text
    assert math.isnan(staleness_stats([], current_version=0)["sample/staleness_mean"])
    with pytest.raises(ValueError):
        filter_stale(samples, current_version=0, max_staleness=-1)
