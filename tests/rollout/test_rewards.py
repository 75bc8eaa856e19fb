"""Reward scoring: sync in threads, async concurrently, failures become NaN and are counted."""

from __future__ import annotations

import math
import threading
import time

import anyio
import pytest

from asyncgrpo.errors import ConfigError
from asyncgrpo.rollout.rewards import RewardScorer, load_reward_func

pytestmark = pytest.mark.anyio


def length_reward(prompts, completions, **kwargs):
    return [float(len(c)) for c in completions]


async def async_reward(prompts, completions, **kwargs):
    await anyio.sleep(0.01)
    return [1.0 if "a" in c else 0.0 for c in completions]


def raising_reward(prompts, completions, **kwargs):
    raise RuntimeError("boom")


def none_reward(prompts, completions, **kwargs):
    return [None if c == "" else 2.0 for c in completions]


async def test_sync_and_async_combined_as_weighted_sum() -> None:
    scorer = RewardScorer([length_reward, async_reward], weights=[1.0, 10.0])
    scores = await scorer.score(["p"] * 3, ["a", "bb", "ccc"])
    assert scores.rewards == [11.0, 2.0, 3.0]
    assert scores.per_func == {
        "length_reward": [1.0, 2.0, 3.0],
        "async_reward": [1.0, 0.0, 0.0],
    }
    assert scores.nan_count == 0 and scorer.nan_total == 0


async def test_raising_function_gives_nan_and_is_counted() -> None:
    scorer = RewardScorer([raising_reward])
    scores = await scorer.score(["p"] * 2, ["x", "y"])
    assert all(math.isnan(r) for r in scores.rewards)
    assert scores.error_count == 1
    assert scorer.error_total == 1 and scorer.nan_total == 2


async def test_one_failing_function_leaves_the_others_nansum() -> None:
    scorer = RewardScorer([length_reward, raising_reward, none_reward])
    scores = await scorer.score(["p"] * 2, ["abc", ""])
    # raising -> NaN everywhere; None for the empty completion; the rest summed (TRL nansum).
    assert scores.rewards == [3.0 + 2.0, 0.0]
    assert math.isnan(scores.per_func["none_reward"][1])
    assert scorer.nan_total == 3


async def test_wrong_length_and_non_numbers_become_nan() -> None:
    scorer = RewardScorer(
        [lambda prompts, completions, **kw: [1.0], lambda prompts, completions, **kw: ["x", 1]]
    )
    assert scorer.names == ["<lambda>", "<lambda>_2"]
    scores = await scorer.score(["p"] * 2, ["a", "b"])
    assert math.isnan(scores.rewards[0])
    assert scores.rewards[1] == 1.0


async def test_sync_functions_run_in_threads_concurrently() -> None:
    main = threading.get_ident()
    seen: list[int] = []

    def slow(prompts, completions, **kwargs):
        seen.append(threading.get_ident())
        time.sleep(0.3)
        return [0.0] * len(completions)

    def slow2(prompts, completions, **kwargs):
        return slow(prompts, completions)

    scorer = RewardScorer([slow, slow2], max_threads=2)
    t0 = time.perf_counter()
    await scorer.score(["p"], ["c"])
    elapsed = time.perf_counter() - t0
    assert main not in seen and len(seen) == 2
    assert elapsed < 0.55, f"two 0.3 s functions took {elapsed:.2f} s: not concurrent"


async def test_kwargs_reach_the_functions() -> None:
    got = {}

    def capture(prompts, completions, *, completion_ids, answer, **kwargs):
        got.update(completion_ids=completion_ids, answer=answer, prompts=prompts)
        return [0.0] * len(completions)

    scorer = RewardScorer([capture])
    await scorer.score(["q", "q"], ["a", "b"], completion_ids=[[1], [2]], answer=["4", "4"])
    assert got == {"completion_ids": [[1], [2]], "answer": ["4", "4"], "prompts": ["q", "q"]}


def test_load_from_import_path(tmp_path, monkeypatch) -> None:
    (tmp_path / "my_rewards.py").write_text(
        "class Box:\n    @staticmethod\n    def fn(prompts, completions, **kw):\n"
        "        return [1.0] * len(completions)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = load_reward_func("my_rewards:Box.fn")
    assert fn([], ["a"]) == [1.0]
    with pytest.raises(ConfigError, match="no attribute"):
        load_reward_func("my_rewards:missing")
    with pytest.raises(ConfigError, match="cannot import"):
        load_reward_func("no_such_module_xyz:fn")
    with pytest.raises(ConfigError, match=r"package\.module:function"):
        load_reward_func("my_rewards.fn")
    with pytest.raises(ConfigError, match="at least one"):
        RewardScorer([])
