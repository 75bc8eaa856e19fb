"""Splitting a request's datums over data-parallel ranks, and putting the outputs back."""

from __future__ import annotations

import numpy as np
import pytest

from asyncgrpo.tinker.ranks import merge_results, shard_datums
from asyncgrpo.tinker.wire import FwdBwdResult


def test_datums_split_by_tokens_each_once() -> None:
    lengths = [40, 6, 7, 5, 8]  # odd count, one long: it goes alone
    shards = shard_datums(lengths, 2)
    assert sorted(i for s in shards for i in s) == list(range(5))
    assert shards == [[0], [1, 2, 3, 4]]
    assert shard_datums([3, 3, 3, 3], 2) == [[0, 2], [1, 3]]


def test_fewer_datums_than_ranks_leave_ranks_empty() -> None:
    assert shard_datums([4], 3) == [[0], [], []]
    assert shard_datums([], 2) == [[], []]


def _result(indices: list[int], loss: float) -> FwdBwdResult:
    return FwdBwdResult(
        outputs=[{"logprobs": np.full(2, float(i))} for i in indices], metrics={"loss:sum": loss}
    )


def test_outputs_come_back_in_the_request_order() -> None:
    shards = [[1, 3], [0, 2, 4]]
    merged = merge_results(5, shards, [_result(s, float(len(s))) for s in shards])
    assert [float(o["logprobs"][0]) for o in merged.outputs] == [0, 1, 2, 3, 4]
    assert merged.metrics == {"loss:sum": 5.0}
    empty = merge_results(1, [[0], []], [_result([0], 1.5), _result([], 0.0)])
    assert len(empty.outputs) == 1 and empty.metrics["loss:sum"] == 1.5


def test_a_datum_in_no_shard_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"datums \[1\] are in no rank's shard"):
        merge_results(2, [[0], []], [_result([0], 0.0), _result([], 0.0)])
