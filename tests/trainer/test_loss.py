"""GRPO loss and its off-policy corrections against a token-by-token reference."""

from __future__ import annotations

import math
import random

import pytest
import torch
from trainer_helpers import reference_loss

from asyncgrpo.trainer.loss import (
    DEFAULT_CAPS,
    Objective,
    add_stats,
    finalize_stats,
    grpo_loss,
    per_token_loss,
    stat_keys,
)

CORRECTIONS = list(DEFAULT_CAPS)
EPS_LO, EPS_HI = 0.2, 0.28


def reference(*args, **kwargs):
    return reference_loss(*args, eps_lo=EPS_LO, eps_hi=EPS_HI, **kwargs)


def _data(n, seed, *, spread=2.0):
    """Tokens of 6 completions; proximal logprobs away from the current ones so that the clip
    around the proximal policy binds too (it does when a batch is reused for several steps)."""
    rng = random.Random(seed)
    old = [-rng.uniform(0.1, 5) for _ in range(n)]
    prox = [o + rng.uniform(-spread, spread) for o in old]  # w from ~0.14 to ~7.4
    logp = [p + rng.uniform(-0.5, 0.5) for p in prox]  # r from ~0.6 to ~1.6
    adv = [rng.choice([-1.0, 0.0, 1.0]) * rng.uniform(0.1, 2) for _ in range(n)]
    seq = sorted(rng.randrange(6) for _ in range(n))
    return logp, prox, old, adv, seq


def t64(x):
    return torch.tensor(x, dtype=torch.float64)


@pytest.mark.parametrize("correction", CORRECTIONS)
@pytest.mark.parametrize("cap", ["default", 1.6])
def test_each_correction_matches_the_reference_loss_and_gradient(correction, cap):
    logp, prox, old, adv, seq = _data(300, seed=0)
    cap = DEFAULT_CAPS[correction] if cap == "default" else cap
    if correction == "none" and cap is not None:
        cap = 3.0  # the dual clip must exceed 1 + epsilon_high
    objective = Objective(correction, cap, EPS_LO, EPS_HI)
    x = t64(logp).requires_grad_()
    loss_t, terms = per_token_loss(
        x,
        t64(old),
        t64(adv),
        objective,
        proximal_logp=t64(prox),
        sequence_ids=torch.tensor(seq),
    )
    loss_t.sum().backward()
    ref_loss, ref_grad = reference(logp, prox, old, adv, seq, correction, cap)
    torch.testing.assert_close(loss_t.detach(), t64(ref_loss), rtol=0, atol=1e-12)
    torch.testing.assert_close(x.grad, t64(ref_grad), rtol=0, atol=1e-12)
    # the data reaches every branch: both clip sides, and the cap where there is one
    assert bool((terms.ratio < 1 - EPS_LO).any()) and bool((terms.ratio > 1 + EPS_HI).any())
    if correction in ("decoupled", "tis") or (correction == "none" and cap is not None):
        assert bool(terms.truncated.any()) and not bool(terms.masked.any())
    elif correction != "none":
        assert bool(terms.masked.any()) and not bool(terms.truncated.any())
        assert not bool(terms.masked.all())


@pytest.mark.parametrize("correction", CORRECTIONS)
def test_default_proximal_policy_is_the_current_one(correction):
    """One optimizer step per batch: r = 1, the clip never binds, the gradient is -f(w) A."""
    logp, _, old, adv, seq = _data(100, seed=1, spread=0.3)
    objective = Objective(correction, epsilon_low=EPS_LO, epsilon_high=EPS_HI)
    x = t64(logp).requires_grad_()
    loss_t, terms = per_token_loss(x, t64(old), t64(adv), objective, sequence_ids=torch.tensor(seq))
    loss_t.sum().backward()
    _, ref_grad = reference(logp, logp, old, adv, seq, correction, DEFAULT_CAPS[correction])
    torch.testing.assert_close(x.grad, t64(ref_grad), rtol=0, atol=1e-12)
    if correction != "none":
        assert torch.equal(terms.ratio, torch.ones(100, dtype=torch.float64))


def test_on_fresh_tokens_the_corrections_coincide():
    """Behaviour ~ proximal, as served at staleness 0 (|log w| < 1e-3): none, decoupled, tis and
    mis_token give the same loss and gradient, -w A per token, which is why the bench runs
    max_staleness 0 once for all of them. mis_sequence weighs each token by the product of w
    over its completion instead; it joins them when behaviour = proximal exactly."""
    logp, _, _, adv, seq = _data(200, seed=2)
    rng = random.Random(3)
    served = [lp + rng.uniform(-1e-3, 1e-3) for lp in logp]
    for old, same in ((served, CORRECTIONS[:-1]), (logp, CORRECTIONS)):
        results = []
        for correction in same:
            x = t64(logp).requires_grad_()
            loss, _ = grpo_loss(
                x,
                t64(old),
                t64(adv),
                Objective(correction),
                num_tokens=200,
                sequence_ids=torch.tensor(seq),
            )
            loss.backward()
            results.append((float(loss.detach()), x.grad))
        for loss, grad in results[1:]:
            assert loss == pytest.approx(results[0][0], abs=1e-12)
            torch.testing.assert_close(grad, results[0][1], rtol=0, atol=1e-12)
    assert CORRECTIONS[-1] == "mis_sequence"


def test_sequence_weight_is_the_product_over_the_completion():
    # two completions: log w sums to +0.6 (W = 1.82, kept) and to +0.9 (W = 2.46, dropped)
    old = t64([-1.0, -1.0, -2.0, -2.0, -2.0])
    prox = old + t64([0.2, 0.4, 0.3, 0.3, 0.3])
    adv = t64([1.0, 1.0, -1.0, -1.0, -1.0])
    loss_t, terms = per_token_loss(
        prox.clone().requires_grad_(),
        old,
        adv,
        Objective("mis_sequence"),
        sequence_ids=torch.tensor([0, 0, 1, 1, 1]),
    )
    assert loss_t.detach().tolist() == pytest.approx([-math.exp(0.6)] * 2 + [0.0] * 3)
    assert terms.masked.tolist() == [False, False, True, True, True]
    with pytest.raises(ValueError, match="sequence_ids"):
        per_token_loss(prox, old, adv, Objective("mis_sequence"))


def test_a_corrupt_behaviour_logprob_is_dropped_not_spread():
    """A NaN behaviour logprob gives a NaN weight: the masking corrections drop the token
    (counted as masked); the others let it poison the step (the trainer then skips it)."""
    old = t64([-1.0, math.nan, -1.0])
    adv = t64([1.0, 1.0, -1.0])
    for correction in CORRECTIONS:
        x = t64([-1.0, -1.0, -1.0]).requires_grad_()
        loss_t, terms = per_token_loss(
            x, old, adv, Objective(correction), sequence_ids=torch.tensor([0, 1, 2])
        )
        loss_t.sum().backward()
        dropped = correction in ("mis_token", "mis_sequence")
        assert bool(torch.isfinite(x.grad).all()) == dropped, correction
        if dropped:
            assert terms.masked.tolist() == [False, True, False]


def test_stats_per_staleness_and_on_policy_ratio():
    # tokens 0-2 fresh (on-policy), 3-4 one version old, 5 two versions old (max_staleness 1:
    # it lands in the last bucket)
    logp = t64([-1.0] * 6)
    log_w = [0.01, -0.01, 0.0, 0.5, 2.0, 1.0]
    old = logp - t64(log_w)
    adv = t64([1.0, -1.0, 0.5, 1.0, 1.0, -1.0])
    staleness = torch.tensor([0, 0, 0, 1, 1, 2])
    _, sums = grpo_loss(
        logp.clone().requires_grad_(),
        old,
        adv,
        Objective("mis_token", cap=2.0),
        num_tokens=6,
        staleness=staleness,
        on_policy=staleness == 0,
        buckets=2,
        sequence_ids=torch.tensor([0, 0, 0, 1, 1, 2]),
        entropy=t64([1.5] * 6),
    )
    assert set(sums) == set(stat_keys(2))
    m = finalize_stats(sums, buckets=2)
    w = [math.exp(v) for v in log_w]
    assert m["ratio"] == pytest.approx(sum(w[:3]) / 3)
    assert m["ratio/tokens"] == pytest.approx(0.5)
    assert m["entropy"] == pytest.approx(1.5)
    assert m["off_policy/staleness_0/tokens"] == pytest.approx(0.5)
    assert m["off_policy/staleness_1/tokens"] == pytest.approx(0.5)
    assert m["off_policy/staleness_1/weight_mean"] == pytest.approx(sum(w[3:]) / 3)
    assert m["off_policy/staleness_1/weight_max"] == pytest.approx(math.exp(2.0))
    assert m["off_policy/staleness_1/masked"] == pytest.approx(2 / 3)  # e^2, e^1 > cap 2
    assert m["off_policy/staleness_0/masked"] == 0.0
    assert m["off_policy/weight_max"] == pytest.approx(math.exp(2.0))
    assert m["off_policy/weight_mean"] == pytest.approx(sum(w) / 6)
    assert m["off_policy/masked"] == pytest.approx(2 / 6)
    assert m["off_policy/truncated"] == 0.0
    assert m["clip_ratio/region_mean"] == 0.0  # r = 1: the proximal clip never binds
    # micro-batches combine: sums add, maxima take the maximum
    total = add_stats(dict(sums), sums)
    assert total["count"] == 12 and total["s1/weight_max"] == sums["s1/weight_max"]
    assert finalize_stats(total, 2)["off_policy/weight_mean"] == m["off_policy/weight_mean"]
    # a bucket without tokens reports its share (0) and nothing else
    _, fresh = grpo_loss(
        logp, old, adv, Objective(), num_tokens=6, buckets=3, sequence_ids=torch.tensor([0] * 6)
    )
    fm = finalize_stats(fresh, 3)
    assert fm["off_policy/staleness_2/tokens"] == 0.0
    assert "off_policy/staleness_2/weight_mean" not in fm


def test_none_with_a_cap_reports_truncated_tokens_like_the_old_dual_clip():
    logp, _, old, adv, _ = _data(200, seed=4)
    _, sums = grpo_loss(
        t64(logp), t64(old), t64(adv), Objective("none", 2.0, 0.2, 0.2), num_tokens=200
    )
    r = [math.exp(a - b) for a, b in zip(logp, old, strict=True)]
    expected = sum(ri > 2.0 and a < 0 for ri, a in zip(r, adv, strict=True))
    assert expected > 0
    assert sums["s0/truncated"] == expected
    m = finalize_stats(sums)
    assert m["clip_ratio/low_mean"] == pytest.approx(
        sum(ri < 0.8 and a < 0 for ri, a in zip(r, adv, strict=True)) / 200
    )


def test_micro_batches_add_up_to_the_token_level_mean():
    logp, _, old, adv, _ = _data(90, seed=1)
    full = torch.tensor(logp, requires_grad=True)
    obj = Objective("none")
    loss, _ = grpo_loss(full, torch.tensor(old), torch.tensor(adv), obj, num_tokens=90)
    loss.backward()
    parts = torch.tensor(logp, requires_grad=True)
    total, sums = 0.0, {}
    for lo, hi in [(0, 10), (10, 55), (55, 90)]:
        part, s = grpo_loss(
            parts[lo:hi], torch.tensor(old[lo:hi]), torch.tensor(adv[lo:hi]), obj, num_tokens=90
        )
        part.backward()
        total += float(part.detach())
        add_stats(sums, s)
    assert total == pytest.approx(float(loss.detach()), abs=1e-6)
    assert torch.allclose(parts.grad, full.grad, atol=1e-7)
    assert sums["count"] == 90


def test_zero_advantage_tokens_give_no_gradient():
    logp, _, old, _, _ = _data(20, seed=2)
    x = torch.tensor(logp, requires_grad=True)
    loss, sums = grpo_loss(x, torch.tensor(old), torch.zeros(20), Objective("none"), num_tokens=20)
    loss.backward()
    assert float(loss.detach()) == 0.0
    assert torch.count_nonzero(x.grad) == 0
    assert sums["clip/region"] == 0


def test_finalize_stats_without_tokens_is_nan():
    assert all(math.isnan(v) for v in finalize_stats({}).values())
    with pytest.raises(ValueError):
        grpo_loss(torch.zeros(0), torch.zeros(0), torch.zeros(0), Objective(), num_tokens=0)
