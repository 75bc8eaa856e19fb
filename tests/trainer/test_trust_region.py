"""The optimizer step's trust region (``trainer.max_update_ratio``): the scale as pure logic, the
cap on tensors, and through ``Trainer.step`` against the same step without it."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from trainer_helpers import make_samples

from asyncgrpo.errors import ConfigError
from asyncgrpo.trainer.config import LoraConfig, TrainerConfig
from asyncgrpo.trainer.loop import Trainer
from asyncgrpo.trainer.trust_region import cap_update, global_norm, update_scale


@pytest.mark.parametrize(
    ("update", "param", "ratio", "want"),
    [(0.5, 10.0, 0.1, 1.0),  # inside: untouched
     (1.0, 10.0, 0.1, 1.0),  # on the boundary
     (4.0, 10.0, 0.1, 0.25),  # 4x the limit of 1.0
     (4.0, 10.0, None, 1.0),  # off
     (4.0, 0.0, 0.1, 1.0),  # an all-zero adapter gives no scale to measure against
     (math.inf, 10.0, 0.1, 1.0)],  # a non-finite step is the gradient check's business
)  # fmt: skip
def test_update_scale(update, param, ratio, want):
    assert update_scale(update, param, ratio) == pytest.approx(want)


def test_cap_update_scales_the_whole_step_by_one_factor():
    gen = torch.Generator().manual_seed(0)
    before = [torch.randn(3, 4, generator=gen), torch.randn(5, generator=gen)]
    steps = [torch.randn(3, 4, generator=gen), torch.randn(5, generator=gen) * 10]
    params = [b + d for b, d in zip(before, steps, strict=True)]
    limit = 0.05 * global_norm(before)
    norm, adapter, scale = cap_update(params, before, 0.05)
    assert scale == pytest.approx(limit / global_norm(steps))
    assert norm == pytest.approx(limit)
    for p, b, d in zip(params, before, steps, strict=True):  # the direction is kept
        torch.testing.assert_close(p, b + d * scale)
    assert adapter == pytest.approx(global_norm(params))
    # within the region nothing moves
    again = [p.clone() for p in params]
    assert cap_update(again, before, 1.0)[2] == 1.0
    assert all(torch.equal(a, p) for a, p in zip(again, params, strict=True))


@pytest.mark.parametrize("value", [0.0, -0.1, math.nan])
def test_bad_max_update_ratio_names_the_field(value):
    with pytest.raises(ConfigError, match=r"trainer\.max_update_ratio="):
        TrainerConfig(max_update_ratio=value)


def _step(model_dir, **overrides) -> tuple[dict[str, float], float]:
    """One step at a learning rate that moves the adapter far: its metrics and the adapter's
    norm before it."""
    cfg = TrainerConfig(learning_rate=0.2, token_budget=64, dtype="float32", **overrides)
    trainer = Trainer(model_dir, lora=LoraConfig(r=2, alpha=4.0), trainer=cfg, device="cpu")
    samples = make_samples(8, seed=1)
    samples = [dataclasses.replace(s, logprobs=lp)
               for s, lp in zip(samples, trainer.logprobs(samples), strict=True)]  # fmt: skip
    before = global_norm([p.detach() for p in trainer.params])
    return trainer.step(samples), before


def test_trust_region_through_the_trainer(tiny_model_dir):
    free, before = _step(tiny_model_dir)
    capped, same = _step(tiny_model_dir, max_update_ratio=0.01)
    assert same == before > 0  # both start from the same adapter (seed 0)
    assert free["collapse/update_scale"] == 1.0
    assert free["collapse/update_norm"] > 0.05 * before
    assert capped["collapse/update_norm"] == pytest.approx(0.01 * before, rel=1e-4)
    assert capped["collapse/update_scale"] == pytest.approx(
        capped["collapse/update_norm"] / free["collapse/update_norm"], rel=1e-4
    )
    assert capped["loss"] == pytest.approx(free["loss"])  # the same gradient, a shorter step
