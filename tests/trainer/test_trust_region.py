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
from asyncgrpo.trainer.trust_region import (
    cap_update,
    global_norm,
    kl_scale,
    token_kl,
    update_scale,
)


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


def test_token_kl_is_k3_of_the_logprob_change():
    old = torch.tensor([-0.1, -2.0, -5.0, -1.0])
    new = torch.tensor([-0.1, -1.0, -0.5, -3.0])
    want = [math.exp(n - o) - 1 - (n - o) for n, o in zip(new.tolist(), old.tolist(), strict=True)]
    torch.testing.assert_close(token_kl(new, old), torch.tensor(want))
    assert token_kl(new, old)[0] == 0.0 and bool((token_kl(new, old) >= 0).all())


@pytest.mark.parametrize(
    ("kl", "cap", "want"),
    [(0.5, 1.0, 1.0), (1.0, 1.0, 1.0), (4.0, 1.0, 0.5), (400.0, 1.0, 0.05), (4.0, None, 1.0),
     (math.nan, 1.0, 1.0)],
)  # fmt: skip
def test_kl_scale_takes_the_change_as_quadratic(kl, cap, want):
    assert kl_scale(kl, cap) == pytest.approx(want)


@pytest.mark.parametrize("field", ["max_update_ratio", "max_update_kl"])
@pytest.mark.parametrize("value", [0.0, -0.1, math.nan])
def test_bad_trust_region_names_the_field(field, value):
    with pytest.raises(ConfigError, match=rf"trainer\.{field}="):
        TrainerConfig(**{field: value})


def _step(model_dir, **overrides) -> tuple[dict[str, float], float, float]:
    """One step at a learning rate that moves the adapter far: its metrics, the adapter's norm
    before it, and how far it moved the policy on its tokens (mean k3, measured afresh)."""
    cfg = TrainerConfig(learning_rate=0.2, token_budget=64, dtype="float32", **overrides)
    trainer = Trainer(model_dir, lora=LoraConfig(r=2, alpha=4.0), trainer=cfg, device="cpu")
    samples = make_samples(8, seed=1)
    old = trainer.logprobs(samples)
    samples = [dataclasses.replace(s, logprobs=lp) for s, lp in zip(samples, old, strict=True)]
    before = global_norm([p.detach() for p in trainer.params])
    metrics = trainer.step(samples)
    new = trainer.logprobs(samples)
    flat = [torch.tensor([x for lp in lps for x in lp]) for lps in (new, old)]
    moved = token_kl(*flat).mean()
    return metrics, before, float(moved)


def test_trust_region_through_the_trainer(tiny_model_dir):
    free, before, _ = _step(tiny_model_dir)
    capped, same, _ = _step(tiny_model_dir, max_update_ratio=0.01)
    assert same == before > 0  # both start from the same adapter (seed 0)
    assert free["collapse/update_scale"] == 1.0
    assert free["collapse/update_norm"] > 0.05 * before
    assert capped["collapse/update_norm"] == pytest.approx(0.01 * before, rel=1e-4)
    assert capped["collapse/update_scale"] == pytest.approx(
        capped["collapse/update_norm"] / free["collapse/update_norm"], rel=1e-4
    )
    assert capped["loss"] == pytest.approx(free["loss"])  # the same gradient, a shorter step
    assert math.isnan(free["collapse/update_kl"])  # not measured: no extra forward


def test_kl_trust_region_through_the_trainer(tiny_model_dir):
    """The KL is measured on the step's tokens after it; above the cap the step is shrunk, and
    the policy then moved less than the free step did."""
    free, _, moved = _step(tiny_model_dir, max_update_kl=1e9)
    assert free["collapse/update_scale"] == 1.0 and free["collapse/update_kl"] > 1e-3
    assert free["collapse/update_kl"] == pytest.approx(moved, rel=1e-3)
    cap = free["collapse/update_kl"] / 100
    capped, _, moved_capped = _step(tiny_model_dir, max_update_kl=cap)
    assert moved_capped < cap * 2
    assert capped["collapse/update_kl"] == pytest.approx(free["collapse/update_kl"], rel=1e-4)
    assert capped["collapse/update_scale"] == pytest.approx(0.1, rel=1e-4)
    assert capped["collapse/update_norm"] == pytest.approx(
        free["collapse/update_norm"] * 0.1, rel=1e-4
    )
