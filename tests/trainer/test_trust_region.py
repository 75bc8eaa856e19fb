"""The optimizer step's trust region in policy space (``trainer.max_update_kl``): the pieces as
pure logic, and through ``Trainer.step`` against the same step without it."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from trainer_helpers import make_samples

from asyncgrpo.config.trainer import LoraConfig, TrainerConfig
from asyncgrpo.errors import ConfigError
from asyncgrpo.trainer.loop import Trainer
from asyncgrpo.trainer.trust_region import global_norm, kl_scale, shrink, token_kl


def test_token_kl_is_k3_of_the_logprob_change():
    old = torch.tensor([-0.1, -2.0, -5.0, -1.0])
    new = torch.tensor([-0.1, -1.0, -0.5, -3.0])
    want = [math.exp(n - o) - 1 - (n - o) for n, o in zip(new.tolist(), old.tolist(), strict=True)]
    kl = token_kl(new, old)
    torch.testing.assert_close(kl, torch.tensor(want))
    assert kl[0] == 0.0 and bool((kl > 0)[1:].all())


@pytest.mark.parametrize(
    ("kl", "cap", "want"),
    [
        (0.5, 1.0, 1.0),
        (1.0, 1.0, 1.0),
        (4.0, 1.0, 0.5),
        (400.0, 1.0, 0.05),
        (4.0, None, 1.0),
        (math.nan, 1.0, 1.0),
    ],
)
def test_kl_scale_takes_the_change_as_quadratic(kl, cap, want):
    assert kl_scale(kl, cap) == pytest.approx(want)


def test_shrink_moves_every_tensor_back_by_one_factor():
    gen = torch.Generator().manual_seed(0)
    before = [torch.randn(3, 4, generator=gen), torch.randn(5, generator=gen)]
    steps = [torch.randn(3, 4, generator=gen), torch.randn(5, generator=gen) * 10]
    params = [b + d for b, d in zip(before, steps, strict=True)]
    shrink(params, before, 0.25)
    for p, b, d in zip(params, before, steps, strict=True):  # the direction is kept
        torch.testing.assert_close(p, b + d * 0.25)
    assert global_norm([p - b for p, b in zip(params, before, strict=True)]) == pytest.approx(
        0.25 * global_norm(steps)
    )
    kept = [p.clone() for p in params]
    shrink(params, before, 1.0)
    assert all(torch.equal(k, p) for k, p in zip(kept, params, strict=True))


@pytest.mark.parametrize("value", [0.0, -0.1, math.nan])
def test_bad_max_update_kl_names_the_field(value):
    with pytest.raises(ConfigError, match=r"trainer\.max_update_kl="):
        TrainerConfig(max_update_kl=value)


def _step(model_dir, *, stale: float = 0.0, **overrides) -> tuple[dict[str, float], float, float]:
    """One step at a learning rate that moves the policy far: its metrics, and how far it
    moved the policy on its tokens, measured afresh (k3 weighted by pi_before / pi_sampler,
    the weights normalised; and unweighted). ``stale``: the sampler's logprobs are the trainer's shifted by up
    to this much per token."""
    cfg = TrainerConfig(learning_rate=0.2, token_budget=64, dtype="float32", **overrides)
    trainer = Trainer(model_dir, lora=LoraConfig(r=2, alpha=4.0), trainer=cfg, device="cpu")
    samples = make_samples(8, seed=1)
    old = trainer.logprobs(samples)
    gen = torch.Generator().manual_seed(2)
    behaviour = [
        (torch.tensor(lp) + stale * (torch.rand(len(lp), generator=gen) * 2 - 1)).tolist()
        for lp in old
    ]
    samples = [
        dataclasses.replace(s, logprobs=lp) for s, lp in zip(samples, behaviour, strict=True)
    ]
    metrics = trainer.step(samples)
    new, old, mu = (
        [x for lp in lps for x in lp] for lps in (trainer.logprobs(samples), old, behaviour)
    )
    k3 = token_kl(torch.tensor(new, dtype=torch.float64), torch.tensor(old, dtype=torch.float64))
    weight = torch.exp(torch.tensor(old, dtype=torch.float64) - torch.tensor(mu))
    return metrics, float((weight * k3).sum() / weight.sum()), float(k3.mean())


def test_kl_trust_region_through_the_trainer(tiny_model_dir):
    """On-policy samples (importance weights 1): the step's KL is the plain mean k3 of its
    tokens; above the cap the update is shrunk by the quadratic rule and the policy moves
    less (the rule is an approximation: the KL after it is not exactly the cap)."""
    off, moved_off, _ = _step(tiny_model_dir)
    assert math.isnan(off["collapse/update_kl"]) and off["collapse/update_scale"] == 1.0
    free, moved, _ = _step(tiny_model_dir, max_update_kl=1e9)  # measured, never binding
    assert free["collapse/update_scale"] == 1.0 and moved == pytest.approx(moved_off)
    assert free["collapse/update_kl"] == pytest.approx(moved, rel=1e-3) and moved > 1e-3
    capped, moved_capped, _ = _step(tiny_model_dir, max_update_kl=moved / 100)
    assert capped["collapse/update_kl"] == pytest.approx(moved, rel=1e-3)
    assert capped["collapse/update_scale"] == pytest.approx(0.1, rel=1e-3)
    assert capped["collapse/update_norm"] == pytest.approx(
        free["collapse/update_norm"] * 0.1, rel=1e-3
    )
    assert capped["loss"] == pytest.approx(free["loss"])  # the same gradient, a shorter step
    assert moved_capped < moved / 2


def test_kl_of_stale_samples_is_weighted_towards_the_policys_own_tokens(tiny_model_dir):
    """Sampler logprobs up to 2 nats off: the step's KL is the importance-weighted one."""
    metrics, moved, unweighted = _step(tiny_model_dir, stale=2.0, max_update_kl=1e9)
    assert metrics["collapse/update_kl"] == pytest.approx(moved, rel=1e-3)
    assert moved != pytest.approx(unweighted, rel=1e-2)  # the weights changed the estimate


@torch.no_grad()
def _vocab_logprobs(trainer: Trainer, samples) -> list[torch.Tensor]:
    """Each sample alone, unpacked: the log next-token distribution at each completion token."""
    out = []
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.completion_ids])
        logits = trainer.model(input_ids=ids, use_cache=False).logits[0].double()
        out.append(torch.log_softmax(logits[len(s.prompt_ids) - 1 : -1], dim=-1))
    return out


def test_vocabulary_kl_sees_what_the_sampled_tokens_do_not(tiny_model_dir):
    """``update_kl: vocab``: the step's KL is KL(after || before) over the whole vocabulary at
    each completion token's position (on-policy samples: the plain mean over tokens), as
    computed naively per unpacked sample; it differs from the sampled tokens' k3."""
    sampled, moved, _ = _step(tiny_model_dir, max_update_kl=1e9)
    cfg = TrainerConfig(
        learning_rate=0.2, token_budget=64, dtype="float32", max_update_kl=1e9, update_kl="vocab"
    )
    trainer = Trainer(tiny_model_dir, lora=LoraConfig(r=2, alpha=4.0), trainer=cfg, device="cpu")
    samples = make_samples(8, seed=1)
    samples = [
        dataclasses.replace(s, logprobs=lp)
        for s, lp in zip(samples, trainer.logprobs(samples), strict=True)
    ]
    before = _vocab_logprobs(trainer, samples)
    metrics = trainer.step(samples)
    after = _vocab_logprobs(trainer, samples)
    per_token = torch.cat([(a.exp() * (a - b)).sum(-1) for a, b in zip(after, before, strict=True)])
    want = float(per_token.mean())
    assert metrics["collapse/update_kl"] == pytest.approx(want, rel=1e-4)
    assert metrics["collapse/update_scale"] == 1.0
    assert want != pytest.approx(moved, rel=0.1)  # not the sampled tokens' k3
    assert sampled["loss"] == pytest.approx(metrics["loss"])  # the same step


def test_bad_update_kl_names_the_field():
    with pytest.raises(ConfigError, match=r"trainer\.update_kl"):
        TrainerConfig(update_kl="full")  # type: ignore[arg-type]


def test_history_measures_the_step_on_the_prompts_before_it_too(tiny_model_dir):
    """``update_kl_history: 1``: a step's KL is the larger of the KL on its own tokens and the
    KL on the previous step's tokens (other prompts), each importance-weighted from its sampler;
    the first step, with no history, is measured as without it."""

    def run(history: int):
        cfg = TrainerConfig(
            learning_rate=0.2,
            token_budget=64,
            dtype="float32",
            max_update_kl=1e9,
            update_kl_history=history,
        )
        trainer = Trainer(
            tiny_model_dir, lora=LoraConfig(r=2, alpha=4.0), trainer=cfg, device="cpu"
        )
        first, second = make_samples(8, seed=1), make_samples(8, seed=2)
        m1 = trainer.step(first)
        old = trainer.logprobs(first)
        m2 = trainer.step(second)
        new = trainer.logprobs(first)
        flat = [
            torch.tensor([x for lp in lps for x in lp], dtype=torch.float64)
            for lps in (old, new, [s.logprobs for s in first])
        ]
        weight = torch.exp(flat[0] - flat[2])
        moved = float((weight * token_kl(flat[1], flat[0])).sum() / weight.sum())
        return m1["collapse/update_kl"], m2["collapse/update_kl"], moved

    own1, own2, _ = run(0)
    hist1, hist2, moved_before = run(1)
    assert hist1 == pytest.approx(own1)
    assert hist2 == pytest.approx(max(own2, moved_before), rel=1e-4)
    assert moved_before != pytest.approx(own2, rel=0.1)


def test_update_rms_bounds_each_coordinates_step_in_learning_rates(tiny_model_dir):
    """``max_update_rms``: a step whose root-mean-square change per coordinate exceeds the
    bound (in learning rates) is shrunk to it, in its own direction; within it nothing moves."""

    def step(
        bound: float | None,
    ) -> tuple[dict[str, float], list[torch.Tensor], list[torch.Tensor]]:
        cfg = TrainerConfig(
            learning_rate=0.2, token_budget=64, dtype="float32", max_update_rms=bound
        )
        trainer = Trainer(
            tiny_model_dir, lora=LoraConfig(r=2, alpha=4.0), trainer=cfg, device="cpu"
        )
        before = [p.detach().clone() for p in trainer.params]
        metrics = trainer.step(make_samples(8, seed=1))
        return metrics, before, [p.detach().clone() for p in trainer.params]

    free, before, after = step(None)
    delta = [a - b for a, b in zip(after, before, strict=True)]
    rms = global_norm(delta) / math.sqrt(sum(d.numel() for d in delta)) / 0.2
    assert rms > 0.5 and free["collapse/update_scale"] == 1.0
    loose, _, after_loose = step(rms * 1.01)
    assert loose["collapse/update_scale"] == 1.0
    assert all(torch.equal(a, b) for a, b in zip(after, after_loose, strict=True))
    tight, _, after_tight = step(rms / 4)
    assert tight["collapse/update_scale"] == pytest.approx(0.25, rel=1e-5)
    for a, b, d in zip(after_tight, before, delta, strict=True):
        torch.testing.assert_close(a, b + d * 0.25)


@pytest.mark.parametrize("value", [0.0, -1.0, math.nan])
def test_bad_max_update_rms_names_the_field(value):
    with pytest.raises(ConfigError, match=r"trainer\.max_update_rms="):
        TrainerConfig(max_update_rms=value)
