"""pass@k and the evaluation summary (pure), the eval section's checks, and the held-out split."""

from __future__ import annotations

import math
from itertools import combinations

import pytest

from asyncgrpo.config import TrainingConfig
from asyncgrpo.config.evaluation import EvalConfig
from asyncgrpo.config.training import example_path
from asyncgrpo.errors import ConfigError
from asyncgrpo.evaluation.scores import Graded, pass_at_k, summarize
from asyncgrpo.rollout.dataset import split_rows


@pytest.mark.parametrize(("n", "c", "k"), [(4, 0, 1), (4, 1, 1), (4, 1, 2), (5, 2, 3), (4, 4, 4)])
def test_pass_at_k_is_the_chance_over_every_draw(n, c, k):
    """Unbiased: the share of all k-subsets of n completions holding at least one pass."""
    passes = [i < c for i in range(n)]
    subsets = list(combinations(passes, k))
    exact = sum(any(s) for s in subsets) / len(subsets)
    assert pass_at_k(n, c, k) == pytest.approx(exact)


def test_pass_at_k_refuses_impossible_counts():
    with pytest.raises(ValueError):
        pass_at_k(2, 3, 1)
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)


def test_summary_counts_a_nan_reward_as_a_failure_and_keys_the_parts():
    graded = [
        Graded(rewards=[1.0, 0.0], per_func={"digits": [1.0, 0.0]}, completion_tokens=[3, 5]),
        Graded(
            rewards=[math.nan, 0.0], per_func={"digits": [math.nan, 0.0]}, completion_tokens=[2, 2]
        ),
    ]
    m = summarize(graded, k=2, threshold=1.0)
    assert m["eval/prompts"] == 2 and m["eval/completions"] == 4
    assert m["eval/reward"] == pytest.approx(1 / 3)  # NaN skipped in the mean
    assert m["eval/pass@1"] == pytest.approx((0.5 + 0.0) / 2)
    assert m["eval/pass@2"] == pytest.approx((1.0 + 0.0) / 2)
    assert m["eval/rewards/digits"] == pytest.approx(1 / 3)
    assert m["eval/completion_tokens"] == pytest.approx(3.0)


def test_eval_section_needs_exactly_one_source_and_sane_sampling():
    with pytest.raises(ConfigError, match=r"exactly one of eval\.path"):
        EvalConfig()
    with pytest.raises(ConfigError, match=r"exactly one of eval\.path"):
        EvalConfig(prompts=["a"], holdout=0.2)
    with pytest.raises(ConfigError, match=r"eval\.num_generations"):
        EvalConfig(prompts=["a"], num_generations=0)
    with pytest.raises(ConfigError, match=r"eval\.holdout"):
        EvalConfig(holdout=0.9)
    greedy = EvalConfig(prompts=["a"], num_generations=1, temperature=0.0)
    assert greedy.temperature == 0.0


def test_a_config_names_the_eval_field_to_fix(tmp_path):
    path = example_path("examples/tiny_cpu.yaml")
    with pytest.raises(ConfigError, match=r"eval\.num_generations"):
        TrainingConfig.from_yaml(path, ['eval.prompts=["q"]', "eval.num_generations=0"])
    with pytest.raises(ConfigError, match=r"eval\.tempreature"):
        TrainingConfig.from_yaml(path, ['eval.prompts=["q"]', "eval.tempreature=0"])


def test_held_out_rows_are_never_training_rows_and_depend_only_on_the_seed():
    rows = [f"prompt {i}" for i in range(40)]
    train, held = split_rows(rows, 0.25, seed=3)
    assert len(held) == 10 and len(train) == 30
    assert set(train).isdisjoint(held) and set(train) | set(held) == set(rows)
    assert split_rows(rows, 0.25, seed=3) == (train, held)
    assert split_rows(rows, 0.25, seed=4)[1] != held
    assert split_rows(rows[:2], 0.5, seed=0)[0]  # something is always left to train on
    with pytest.raises(ConfigError, match="at least 2"):
        split_rows(rows[:1], 0.5, seed=0)
