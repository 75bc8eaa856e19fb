"""The off-policy corrections through ``Trainer.step``: LoRA gradients against a hand-built
reference, staleness and on-policy tokens, and the failure they exist to prevent."""

from __future__ import annotations

import dataclasses
import math
import random
import statistics

import pytest
import torch
from staleness_sim import When, broken_adapter, demo_recipe, forced_spike, random_spike, simulate
from trainer_helpers import make_samples, reference_loss

from asyncgrpo.config.trainer import LoraConfig, TrainerConfig
from asyncgrpo.trainer.loop import Trainer
from asyncgrpo.trainer.loss import DEFAULT_CAPS

EPS_LO, EPS_HI = 0.2, 0.28


def _trainer(model_dir, correction: str, **overrides) -> Trainer:
    cfg = dict(
        learning_rate=1e-3,
        token_budget=64,
        max_grad_norm=None,
        dtype="float32",
        epsilon=EPS_LO,
        epsilon_high=EPS_HI,
        off_policy=correction,
        max_staleness=2,
    )
    cfg |= overrides
    trainer = Trainer(
        model_dir, lora=LoraConfig(r=2, alpha=4.0), trainer=TrainerConfig(**cfg), device="cpu"
    )
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():  # a non-zero B: with B = 0 every A gradient vanishes
        for p in trainer.params:
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return trainer


def _token_logprobs(model, sample) -> torch.Tensor:
    """The sample's completion logprobs with grad, from one plain unpacked forward."""
    ids = torch.tensor([sample.prompt_ids + sample.completion_ids])
    logits = model(input_ids=ids, use_cache=False).logits[0].float() / sample.temperature
    p = len(sample.prompt_ids)
    logp = torch.log_softmax(logits[p - 1 : -1], dim=-1)
    return logp.gather(-1, torch.tensor(sample.completion_ids).unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("correction", list(DEFAULT_CAPS))
def test_lora_gradients_of_each_correction_equal_the_reference(
    tiny_model_dir, tmp_path, correction
):
    """Stale samples (versions 0-2, behaviour logprobs up to 2 nats off the trainer's) through
    ``Trainer.step`` (packed rows, micro-batches): the loss equals the reference formula's and
    every LoRA gradient equals sum_t dloss/dlogp_t * grad(logp_t), the coefficients from the
    plain-Python reference and the logprobs from a plain unpacked forward."""
    trainer = _trainer(tiny_model_dir, correction)
    rng = random.Random(1)
    samples = make_samples(12, seed=3, temperature=0.8)
    current = trainer.logprobs(samples)
    samples = [
        dataclasses.replace(s, version=i % 3, logprobs=[lp + rng.uniform(-2, 2) for lp in cur])
        for i, (s, cur) in enumerate(zip(samples, current, strict=True))
    ]
    trainer.save_adapter(tmp_path / "v2", version=2)  # the trainer's weights are version 2
    grads: dict[str, torch.Tensor] = {}
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    trainer.optimizer.register_step_pre_hook(
        lambda *_: grads.update({names[id(p)]: p.grad.clone() for p in trainer.params})
    )
    metrics = trainer.step(samples)
    assert metrics["batch/microbatches_per_step"] > 1

    # the reference: hand-computed dloss/dlogp per token (proximal = the logprobs at the
    # start of the step, as the trainer takes them), then the chain rule through a plain forward
    cap = DEFAULT_CAPS[correction]
    n = sum(len(s.completion_ids) for s in samples)
    old = [x for s in samples for x in s.logprobs]
    prox = [x for lp in current for x in lp]
    adv = [s.advantage for s in samples for _ in s.completion_ids]
    seq = [i for i, s in enumerate(samples) for _ in s.completion_ids]
    losses, coef = reference_loss(
        prox, prox, old, adv, seq, correction, cap, eps_lo=EPS_LO, eps_hi=EPS_HI
    )
    assert metrics["loss"] == pytest.approx(sum(losses) / n, abs=1e-6)
    reference = _trainer(tiny_model_dir, correction)
    logp = torch.cat([_token_logprobs(reference.model, s) for s in samples])
    torch.testing.assert_close(logp.detach(), torch.tensor(prox), rtol=0, atol=1e-5)
    (torch.tensor(coef) / n * logp).sum().backward()
    want = {n: p.grad for n, p in reference.model.named_parameters() if p.requires_grad}
    assert set(grads) == set(want)
    assert max(float(g.abs().max()) for g in want.values()) > 1e-3
    for name, g in want.items():
        torch.testing.assert_close(grads[name], g, rtol=0, atol=1e-6, msg=name)
    # the caps bound or dropped some tokens, as the data meant them to
    if correction in ("decoupled", "tis"):
        assert metrics["off_policy/truncated"] > 0
    elif correction != "none":
        assert 0 < metrics["off_policy/masked"] < 1


def test_staleness_is_counted_per_token_from_the_published_version(tiny_model_dir, tmp_path):
    trainer = _trainer(tiny_model_dir, "decoupled", max_staleness=2)
    samples = make_samples(9, seed=4)
    samples = [dataclasses.replace(s, version=5 + i % 3) for i, s in enumerate(samples)]
    samples = [
        dataclasses.replace(s, logprobs=lp)
        for s, lp in zip(samples, trainer.logprobs(samples), strict=True)
    ]
    tokens = {v: sum(len(s.completion_ids) for s in samples if s.version == v) for v in (5, 6, 7)}
    n = sum(tokens.values())
    # never published: staleness counts from the newest sample, whose tokens are on-policy
    m = trainer.step(samples)
    assert m["off_policy/staleness_0/tokens"] == pytest.approx(tokens[7] / n)
    assert m["off_policy/staleness_2/tokens"] == pytest.approx(tokens[5] / n)
    assert m["ratio/tokens"] == pytest.approx(tokens[7] / n)
    assert m["ratio"] == pytest.approx(1.0, abs=1e-5)  # behaviour = these very weights
    # published as version 8 after that step: the version-7 tokens are one version old now
    trainer.save_adapter(tmp_path / "v8", version=8)
    assert trainer.policy_clock(samples) == (8, True)
    m = trainer.step(samples)
    assert m["off_policy/staleness_1/tokens"] == pytest.approx(tokens[7] / n)
    assert m["off_policy/staleness_2/tokens"] == pytest.approx((tokens[6] + tokens[5]) / n)
    assert math.isnan(m["ratio"]) and m["ratio/tokens"] == 0.0  # no token at version 8
    # a step later the weights are no longer version 8's: nothing counts as on-policy
    fresh = [dataclasses.replace(s, version=8) for s in samples]
    assert trainer.policy_clock(fresh) == (8, False)
    assert math.isnan(trainer.step(fresh)["ratio"])
    assert trainer.policy_clock(fresh) == (8, False)


def test_without_the_correction_stale_samples_stop_teaching(tiny_model):
    """Async GRPO at the demo's learning rate with every sample two versions old (no vLLM:
    ``staleness_sim``): the default correction learns, today's PPO objective does not. Both
    over two seeds; over seeds 0-4 the last-5-step reward was 0.77-1.00 with ``decoupled``,
    0.04-0.08 with ``none``, and 0.75-1.00 without staleness."""
    last5 = {}
    for correction in ("decoupled", "none"):
        runs = [
            simulate(tiny_model, off_policy=correction, staleness=2, steps=30, seed=s)
            for s in (0, 1)
        ]
        last5[correction] = statistics.fmean(statistics.fmean(r[-5:]) for r in runs)
    assert last5["decoupled"] > 0.6, last5
    assert last5["none"] < 0.3, last5


def _kept(rewards: list[float], reach: float = 0.9, window: int = 3) -> float | None:
    """After the 3-step mean first reaches ``reach``, its lowest value from there on."""
    means = [statistics.fmean(rewards[k - window : k]) for k in range(window, len(rewards) + 1)]
    first = next((i for i, m in enumerate(means) if m >= reach), None)
    return None if first is None else min(means[first:])


@pytest.mark.parametrize("seed", [5, 13])
def test_learning_stays_learned_over_a_long_horizon(tiny_model, seed):
    """Every sample 4 versions old, 100 steps, the demo's optimisation settings
    (examples/tiny_cpu.yaml, its trust region on the step included), and the event the trust
    region exists for, made: as the run takes off (the first step whose samples' mean reward
    reaches 0.3), three steps in a row each move the adapter 10 times as far as the optimizer
    says, while the samples that would show it are still 4 versions old (docs/trainer.md, "The
    trust region"). The trust region shortens them, and once the 3-step mean reward
    reaches 0.9 it never falls below 0.8. Without the trust region the same spikes throw the
    run back for tens of steps (docs/testing.md)."""
    spikes = When(forced_spike(10.0), reach=0.3, count=3)
    records: list[dict[str, float]] = []
    rewards = simulate(
        tiny_model,
        staleness=4,
        steps=100,
        seed=seed,
        records=records,
        events=dict.fromkeys(range(100), spikes),
        **demo_recipe(),
    )
    assert len(spikes.steps) == 3, f"never took off: {[round(r, 2) for r in rewards]}"
    scales = [records[i]["collapse/update_scale"] for i in spikes.steps]
    assert min(scales) < 1.0, ("the trust region never shortened a spike", scales)
    kept = _kept(rewards)
    assert kept is not None, f"never reached 0.9: {rewards[-10:]}"
    assert kept >= 0.8, (kept, [round(r, 2) for r in rewards])


def test_a_gradient_spike_after_convergence_is_bounded(tiny_model):
    """Synchronously (fresh samples), the demo recipe with max_update_rms 1.5, and the event it
    exists for, made: five steps after the 3-step mean reward first reaches 0.9, one step moves
    every adapter coordinate by 30 learning rates (RMS) in a random direction, what AdamW does
    to a gradient in directions with little history after steps of near-zero gradient (seed 13
    of the simulation met two such spikes on one CPU, its 3-step mean reward fell to 0.777:
    docs/benchmarks.md, "Stability and collapse"). The KL on the step's sampled tokens does not
    stop it: without max_update_rms the reward falls to near 0 (docs/testing.md). Bounding the step's
    RMS per coordinate at 1.5 learning rates shortens that step, and the run keeps its reward:
    the 3-step mean stays at 0.8 or more."""
    recipe = demo_recipe() | {"max_update_rms": 1.5}
    spike = When(random_spike(30.0), reach=0.9, window=3, after=5)
    records: list[dict[str, float]] = []
    rewards = simulate(
        tiny_model,
        staleness=0,
        steps=48,
        seed=13,
        records=records,
        events=dict.fromkeys(range(48), spike),
        **recipe,
    )
    assert len(spike.steps) == 1, f"never converged: {[round(r, 2) for r in rewards]}"
    (at,) = spike.steps
    assert records[at]["collapse/update_scale"] < 0.1, records[at]
    kept = _kept(rewards)
    assert kept is not None and kept >= 0.8, (kept, [round(r, 2) for r in rewards])


def test_a_collapsed_run_is_rolled_back_to_the_policy_that_earned_its_reward(tiny_model):
    """The collapse rollback end to end, on a collapse the test makes: samples 4 versions old,
    the demo recipe with collapse_action=rollback, and two steps after the 3-step mean reward
    first reaches 0.9 the adapter comes apart (noise on every LoRA weight). The samples of the
    next 4 steps still come from sound versions; then the broken ones' score nothing. The alarm
    fires once, on them, and the rollback restores the published version that sampled the best
    rewards, a policy that had not come apart (its entropy on the next step is low, not the
    near-uniform one of the broken adapter, which was current when the best rewards arrived),
    and the run ends converged."""
    records: list[dict[str, float]] = []
    recipe = demo_recipe() | {"collapse_action": "rollback"}
    broken = When(broken_adapter(1.0), reach=0.9, window=3, after=2)
    rewards = simulate(
        tiny_model,
        staleness=4,
        steps=48,
        seed=5,
        records=records,
        events=dict.fromkeys(range(48), broken),
        **recipe,
    )
    assert len(broken.steps) == 1, f"never converged: {[round(r, 2) for r in rewards]}"
    (at,) = broken.steps
    fired = [i for i, r in enumerate(records) if r["collapse/alarm"] == 1.0 and i >= at]
    assert len(fired) == 1 and fired[0] > at + 4, (at, fired)
    assert records[fired[0] + 1]["entropy"] < 3.0, [round(r["entropy"], 2) for r in records]
    assert statistics.fmean(rewards[-5:]) >= 0.9, [round(r, 2) for r in rewards]
