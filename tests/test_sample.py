"""Group advantages against a statistics-module reference."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from asyncgrpo.sample import group_advantages, group_stats


def _naive(rewards, eps):
    valid = [r for r in rewards if not math.isnan(r)]
    if len(valid) < 2 or len(set(valid)) == 1:
        return [0.0] * len(rewards)
    mean, std = statistics.mean(valid), statistics.stdev(valid)
    return [0.0 if math.isnan(r) else (r - mean) / (std + eps) for r in rewards]


def test_matches_reference_on_random_groups():
    rng = random.Random(0)
    for _ in range(200):
        g = rng.randint(2, 16)
        rewards = [rng.choice([0.0, 1.0, rng.random(), math.nan]) for _ in range(g)]
        got = group_advantages(rewards, eps=1e-4)
        assert got == pytest.approx(_naive(rewards, 1e-4), abs=1e-9)


def test_zero_variance_group_is_exactly_zero():
    assert group_advantages([0.1] * 8) == [0.0] * 8  # 0.1 * 8 / 8 != 0.1 in floating point
    assert group_advantages([1.0, 1.0, math.nan]) == [0.0, 0.0, 0.0]


def test_nan_rewards_get_zero_and_do_not_shift_siblings():
    got = group_advantages([1.0, 0.0, math.nan, 1.0, 0.0])
    ref = group_advantages([1.0, 0.0, 1.0, 0.0])
    assert got[2] == 0.0
    assert [got[0], got[1], got[3], got[4]] == pytest.approx(ref)
    assert sum(got) == pytest.approx(0.0, abs=1e-12)


def test_too_few_valid_rewards():
    assert group_advantages([math.nan, 2.0]) == [0.0, 0.0]
    assert group_advantages([]) == []


def test_group_stats():
    mean, std = group_stats([1.0, 3.0, math.nan])
    assert mean == 2.0
    assert std == pytest.approx(statistics.stdev([1.0, 3.0]))
    assert math.isnan(group_stats([math.nan])[0])
    assert math.isnan(group_stats([2.0])[1])


def test_sample_checks_mask_and_versions() -> None:
    from asyncgrpo.sample import Sample

    base = dict(
        prompt_ids=[1],
        completion_ids=[2, 3, 4],
        logprobs=[-1.0, 0.0, -1.0],
        reward=1.0,
        advantage=0.0,
        group_id="g",
    )
    s = Sample(**base, version=2, completion_mask=[True, False, True], versions=[2, 2, 3])
    assert s.num_policy_tokens == 2 and s.token_versions() == [2, 2, 3]
    plain = Sample(**base, version=5)
    assert plain.policy_mask() == [True] * 3 and plain.token_versions() == [5] * 3
    with pytest.raises(ValueError, match="2 completion_mask for 3"):
        Sample(**base, version=2, completion_mask=[True, False])
    with pytest.raises(ValueError, match="1 versions for 3"):
        Sample(**base, version=2, versions=[2])
    with pytest.raises(ValueError, match="oldest token is at version 2"):
        Sample(**base, version=3, versions=[2, 3, 3])
