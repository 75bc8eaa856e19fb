"""The math reward on fixture rows in the recipe dataset's schema, through the real scorer."""

from __future__ import annotations

import functools
import math
import time
from pathlib import Path

import pytest

from asyncgrpo.rewards.math import math_reward, reference_answers, verify_answer
from asyncgrpo.rollout.rewards import RewardScorer, load_reward_func

pytest.importorskip("math_verify")
pytestmark = pytest.mark.anyio

FIXTURE = Path(__file__).parent / "fixtures" / "math_sanity.jsonl"
HANGS = r"So the answer is \boxed{9^{9^{9^{9}}}}"  # sympy never finishes comparing this


def _rows() -> list[dict]:
    import json

    return [json.loads(line) for line in FIXTURE.read_text().splitlines() if line.strip()]


async def _score_group(scorer: RewardScorer, row: dict, texts: list[str]):
    """As the rollout client calls it: chat completions, every extra column repeated G times."""
    k = len(texts)
    kwargs = {key: [value] * k for key, value in row.items() if key != "prompt"}
    completions = [[{"role": "assistant", "content": t}] for t in texts]
    return await scorer.score([row["prompt"]] * k, completions, **kwargs)


async def test_correct_wrong_unparseable_and_boxed_answers() -> None:
    scorer = RewardScorer(["asyncgrpo.rewards.math:math_reward"])
    half, square, product = _rows()
    scores = await _score_group(
        scorer,
        half,
        [
            r"Dividing, we get $\boxed{\frac{1}{2}}$.",  # boxed, same form
            r"3/6 = 0.5, so \boxed{0.5}",  # boxed, equivalent value
            r"The answer is \boxed{\dfrac{2}{4}}",  # equivalent fraction
            r"\boxed{2}",  # wrong
            "I am not sure what the answer is.",  # nothing to parse
            r"\boxed{\frac{1}{2",  # unbalanced braces
        ],
    )
    assert scores.rewards == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    assert scores.error_count == 0
    scores = await _score_group(
        scorer, square, [r"$\boxed{(x+1)^2}$", r"\boxed{x^2+1}", "So it is $x^2 + 2x + 1$."]
    )
    assert scores.rewards == [1.0, 0.0, 1.0]
    # the boxed answer wins over other numbers in the text
    scores = await _score_group(
        scorer, product, [r"Not 41 or 43: \boxed{42}", r"It is 42, no wait, \boxed{41}"]
    )
    assert scores.rewards == [1.0, 0.0]


async def test_check_that_hangs_times_out_and_scores_zero() -> None:
    # Warm two worker processes first: the timeout also covers a cold worker's imports.
    warm = await _score_group(RewardScorer([math_reward]), _rows()[2], [r"\boxed{42}"] * 2)
    assert warm.rewards == [1.0, 1.0]
    scorer = RewardScorer([functools.partial(math_reward, timeout_s=3.0)])
    t0 = time.monotonic()
    scores = await _score_group(scorer, _rows()[2], [HANGS, r"\boxed{42}"])
    assert scores.rewards == [0.0, 1.0]
    assert time.monotonic() - t0 < 30
    # the hung worker was killed: the next group is scored promptly
    t0 = time.monotonic()
    scores = await _score_group(scorer, _rows()[2], [r"\boxed{42}"] * 4)
    assert scores.rewards == [1.0] * 4
    assert time.monotonic() - t0 < 20


async def test_missing_reference_column_is_nan_and_counted(caplog) -> None:
    scorer = RewardScorer([math_reward])
    scores = await scorer.score(["p"] * 2, [r"\boxed{1}", r"\boxed{2}"])
    assert all(math.isnan(r) for r in scores.rewards)
    assert scores.error_count == 1
    assert "reference answer in a dataset column" in caplog.text


def test_reference_columns_and_pure_check() -> None:
    assert reference_answers(2, {"answer": ["3", 4]}) == ["3", "4"]
    assert reference_answers(1, {"reward_model": [{"ground_truth": "x"}]}) == ["x"]
    assert reference_answers(1, {"solution": [r"$\boxed{5}$"]}) == [r"$\boxed{5}$"]
    with pytest.raises(ValueError, match="2 reference answers for 3"):
        reference_answers(3, {"answer": ["1", "2"]})
    assert verify_answer(r"\boxed{5}", r"$\boxed{5}$") == 1.0
    with pytest.raises(ValueError, match="does not parse"):
        verify_answer(r"\boxed{5}", "")
    assert load_reward_func("asyncgrpo.rewards.math:math_reward") is math_reward
