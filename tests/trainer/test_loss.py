"""GRPO loss against a token-by-token reference."""

from __future__ import annotations

import math
import random

import pytest
import torch

from asyncgrpo.trainer.loss import add_stats, finalize_stats, grpo_loss, per_token_loss


def _naive(logp, old, adv, eps_lo, eps_hi, cap):
    """Plain-Python loss and metric sums, one token at a time."""
    losses, sums = [], dict.fromkeys(["ratio", "kl", "low", "high", "region", "tis"], 0.0)
    for lp, o, a in zip(logp, old, adv, strict=True):
        r = math.exp(lp - o)
        c = min(max(r, 1 - eps_lo), 1 + eps_hi)
        loss = -min(r * a, c * a)
        if cap is not None and a < 0:
            loss = min(loss, -cap * a)
        losses.append(loss)
        sums["ratio"] += r
        sums["kl"] += (r - 1) - (lp - o)
        low = r < 1 - eps_lo and a < 0
        high = r > 1 + eps_hi and a > 0
        sums["low"] += low
        sums["high"] += high
        sums["region"] += low or high
        sums["tis"] += cap is not None and r > cap and a < 0
    return losses, sums


def _data(n, seed):
    rng = random.Random(seed)
    old = [-rng.uniform(0.1, 5) for _ in range(n)]
    logp = [o + rng.uniform(-1.5, 1.5) for o in old]  # ratios from ~0.2 to ~4.5
    adv = [rng.choice([-1.0, 0.0, 1.0]) * rng.uniform(0.1, 2) for _ in range(n)]
    return logp, old, adv


@pytest.mark.parametrize("cap", [None, 2.0])
def test_per_token_loss_and_stats_match_reference(cap):
    logp, old, adv = _data(200, seed=0)
    t = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    loss_t, ratio = per_token_loss(
        t(logp), t(old), t(adv), epsilon_low=0.2, epsilon_high=0.28, tis_cap=cap
    )
    ref_losses, ref = _naive(logp, old, adv, 0.2, 0.28, cap)
    assert torch.allclose(loss_t, t(ref_losses), atol=1e-12)
    assert torch.allclose(ratio, t([math.exp(a - b) for a, b in zip(logp, old, strict=True)]))
    entropy = t([1.5] * 200)
    loss, sums = grpo_loss(
        t(logp),
        t(old),
        t(adv),
        num_tokens=500,
        epsilon_low=0.2,
        epsilon_high=0.28,
        tis_cap=cap,
        entropy=entropy,
    )
    assert float(loss) == pytest.approx(sum(ref_losses) / 500, abs=1e-12)
    assert sums["count"] == 200
    assert sums["ratio"] == pytest.approx(ref["ratio"])
    assert sums["kl"] == pytest.approx(ref["kl"])
    assert sums["entropy"] == pytest.approx(300.0)
    assert sums["clip_ratio/low_mean"] == ref["low"] > 0
    assert sums["clip_ratio/high_mean"] == ref["high"] > 0
    assert sums["clip_ratio/region_mean"] == ref["region"]
    assert sums["clip_ratio/tis_mean"] == ref["tis"]
    if cap is not None:
        assert ref["tis"] > 0
    means = finalize_stats(sums, with_tis=cap is not None)
    assert means["ratio"] == pytest.approx(ref["ratio"] / 200)
    assert ("clip_ratio/tis_mean" in means) == (cap is not None)


def test_micro_batches_add_up_to_the_token_level_mean():
    logp, old, adv = _data(90, seed=1)
    full = torch.tensor(logp, requires_grad=True)
    loss, _ = grpo_loss(
        full, torch.tensor(old), torch.tensor(adv), num_tokens=90, epsilon_low=0.2, epsilon_high=0.2
    )
    loss.backward()
    parts = torch.tensor(logp, requires_grad=True)
    total, sums = 0.0, {}
    for lo, hi in [(0, 10), (10, 55), (55, 90)]:
        part, s = grpo_loss(
            parts[lo:hi],
            torch.tensor(old[lo:hi]),
            torch.tensor(adv[lo:hi]),
            num_tokens=90,
            epsilon_low=0.2,
            epsilon_high=0.2,
        )
        part.backward()
        total += float(part.detach())
        add_stats(sums, s)
    assert total == pytest.approx(float(loss.detach()), abs=1e-6)
    assert torch.allclose(parts.grad, full.grad, atol=1e-7)
    assert sums["count"] == 90


def test_zero_advantage_tokens_give_no_gradient():
    logp, old, _ = _data(20, seed=2)
    x = torch.tensor(logp, requires_grad=True)
    loss, sums = grpo_loss(
        x, torch.tensor(old), torch.zeros(20), num_tokens=20, epsilon_low=0.2, epsilon_high=0.2
    )
    loss.backward()
    assert float(loss.detach()) == 0.0
    assert torch.count_nonzero(x.grad) == 0
    assert sums["clip_ratio/region_mean"] == 0


def test_gradient_matches_reference_regions():
    """Unclipped tokens get d(-rA)/dlogp = -rA; clipped ones get 0; capped ones get 0."""
    logp, old, adv = _data(200, seed=3)
    x = torch.tensor(logp, dtype=torch.float64, requires_grad=True)
    loss, _ = grpo_loss(
        x,
        torch.tensor(old, dtype=torch.float64),
        torch.tensor(adv, dtype=torch.float64),
        num_tokens=1,
        epsilon_low=0.2,
        epsilon_high=0.2,
        tis_cap=2.5,
    )
    loss.backward()
    for i, (lp, o, a) in enumerate(zip(logp, old, adv, strict=True)):
        r = math.exp(lp - o)
        clipped = (a > 0 and r > 1.2) or (a < 0 and r < 0.8)
        capped = a < 0 and r > 2.5
        expected = 0.0 if (clipped or capped or a == 0) else -r * a
        assert float(x.grad[i]) == pytest.approx(expected, abs=1e-12)


def test_finalize_stats_without_tokens_is_nan():
    assert all(math.isnan(v) for v in finalize_stats({}).values())
    with pytest.raises(ValueError):
        grpo_loss(
            torch.zeros(0), torch.zeros(0), torch.zeros(0), num_tokens=0, epsilon_low=0.2,
            epsilon_high=0.2,
        )  # fmt: skip
