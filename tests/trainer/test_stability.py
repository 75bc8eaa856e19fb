"""The options against late collapse: advantage scaling, loss normalisation, the KL
penalty to the base model, each against naive reference code; the collapse alarm step by step;
and the alarm's actions through ``Trainer.step``."""

from __future__ import annotations

import dataclasses
import math
import random
import statistics

import pytest
import torch
from trainer_helpers import make_samples

from asyncgrpo.config.trainer import LoraConfig, TrainerConfig
from asyncgrpo.errors import ConfigError
from asyncgrpo.sample import centred_advantages, group_advantages, scale_advantages
from asyncgrpo.trainer.collapse import CollapseDetector
from asyncgrpo.trainer.loop import Trainer
from asyncgrpo.trainer.loss import Objective, grpo_loss, per_token_loss, token_normaliser


def _groups(seed: int, n_groups: int = 5, size: int = 8) -> tuple[list[float], list[str]]:
    rng = random.Random(seed)
    rewards, ids = [], []
    for g in range(n_groups):
        kind = g % 4
        for _ in range(size):
            if kind == 0:  # a converged group: near-identical rewards
                r = 1.0 - (0.03 if rng.random() < 0.15 else 0.0)
            elif kind == 1:  # all equal
                r = 0.5
            else:
                r = rng.random()
            rewards.append(r)
            ids.append(f"g{g}")
    rewards[3] = math.nan  # a failed reward function
    return rewards, ids


def _naive(rewards: list[float], ids: list[str], scale: str) -> list[float]:
    """TRL's formula, written out: mean per group, std per group or over the batch."""
    by: dict[str, list[float]] = {}
    for r, g in zip(rewards, ids, strict=True):
        if not math.isnan(r):
            by.setdefault(g, []).append(r)
    valid = [r for r in rewards if not math.isnan(r)]
    out = []
    for r, g in zip(rewards, ids, strict=True):
        members = by[g]
        if math.isnan(r) or len(members) < 2 or statistics.stdev(members) <= 1e-8:
            out.append(0.0)
            continue
        centred = r - statistics.fmean(members)
        if scale == "none":
            out.append(centred)
        elif scale == "group":
            out.append(centred / (statistics.stdev(members) + 1e-4))
        else:
            out.append(centred / (statistics.stdev(valid) + 1e-4))
    return out


def _rollout_advantages(rewards: list[float], ids: list[str]) -> list[float]:
    """What the rollout client attaches: ``group_advantages`` per group."""
    out = [0.0] * len(rewards)
    for g in dict.fromkeys(ids):
        idx = [i for i, x in enumerate(ids) if x == g]
        for i, a in zip(idx, group_advantages([rewards[i] for i in idx]), strict=True):
            out[i] = a
    return out


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_scaled_advantages_equal_trls_formula(scale, seed):
    rewards, ids = _groups(seed)
    got = scale_advantages(rewards, _rollout_advantages(rewards, ids), ids, scale)
    assert got == pytest.approx(_naive(rewards, ids, scale), abs=1e-9)


def test_centred_advantages_of_a_group_split_over_two_steps():
    """Half a group in this step: its r - mean is still the whole group's."""
    rewards = [0.1, 0.4, 0.9, 0.3, 0.8, 0.2]
    advs = group_advantages(rewards)
    mean = statistics.fmean(rewards)
    got = centred_advantages(rewards[:3], advs[:3], ["g"] * 3)
    assert got == pytest.approx([r - mean for r in rewards[:3]], abs=1e-12)
    # a lone sample: its scale is unknown, it is left out rather than guessed
    assert centred_advantages(rewards[:1], advs[:1], ["g"]) == [0.0]


def test_near_identical_rewards_get_full_size_advantages_only_with_group_scaling():
    """The amplification behind late collapse: a converged group (seven 1.0, one 0.97)."""
    rewards = [1.0] * 7 + [0.97]
    advs = group_advantages(rewards)
    assert min(advs) < -2.4  # group: as large as in a group of rewards 0 and 1
    assert min(scale_advantages(rewards, advs, ["g"] * 8, "none")) == pytest.approx(-0.02625)


def test_scale_advantages_rejects_unknown_scale():
    with pytest.raises(ValueError, match="scale_rewards"):
        scale_advantages([1.0, 0.0], [0.7, -0.7], ["g", "g"], "groups")


def _naive_loss(loss_type, losses_by_seq: list[list[float]], max_length: int) -> float:
    if loss_type == "dapo":
        return sum(map(sum, losses_by_seq)) / sum(map(len, losses_by_seq))
    if loss_type == "grpo":
        return statistics.fmean(statistics.fmean(s) for s in losses_by_seq)
    return sum(map(sum, losses_by_seq)) / (len(losses_by_seq) * max_length)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_token_normaliser_against_the_written_out_means(loss_type):
    rng = random.Random(4)
    lengths = [1, 3, 7, 2, 5]
    losses = [[rng.uniform(-1, 1) for _ in range(n)] for n in lengths]
    seq_ids = torch.tensor([i for i, n in enumerate(lengths) for _ in range(n)])
    per_token = torch.tensor([x for s in losses for x in s], dtype=torch.float64)
    # two micro-batches, as the trainer splits a step: the sums add up to the step's loss
    total = 0.0
    for part in (seq_ids < 2, seq_ids >= 2):
        norm = token_normaliser(
            loss_type,
            torch.tensor(lengths)[seq_ids[part]],
            num_tokens=sum(lengths),
            num_sequences=len(lengths),
            max_length=8,
        )
        total += float((per_token[part] * norm.double()).sum())
    assert total == pytest.approx(_naive_loss(loss_type, losses, 8), rel=1e-6)


def test_kl_penalty_adds_beta_times_k3_and_its_gradient():
    torch.manual_seed(0)
    logp = (torch.rand(6) * -3).requires_grad_()
    ref = torch.rand(6) * -3
    adv = torch.randn(6)
    beta = 0.3
    objective = Objective(beta=beta)
    loss, terms = per_token_loss(logp, logp.detach(), adv, objective, reference_logp=ref)
    d = ref - logp.detach()
    assert terms.kl_ref == pytest.approx(torch.exp(d) - d - 1)
    assert loss.detach() == pytest.approx(-adv + beta * (torch.exp(d) - d - 1), abs=1e-6)
    loss.sum().backward()
    # d/dlogp of -A logp + beta (e^(ref - logp) - (ref - logp) - 1) at ratio 1
    assert logp.grad == pytest.approx(-adv + beta * (1 - torch.exp(d)), abs=1e-5)
    with pytest.raises(ValueError, match="reference_logp"):
        per_token_loss(logp, logp.detach(), adv, objective)
    # and the step's metric
    _, sums = grpo_loss(logp, logp.detach(), adv, objective, num_tokens=6, reference_logp=ref)
    assert sums["kl_ref"] / sums["kl_ref/count"] == pytest.approx(
        float((torch.exp(d) - d - 1).mean())
    )


# ---- the collapse alarm -------------------------------------------------------------------


def _feed(detector: CollapseDetector, rewards: list[float]) -> list[int]:
    """1-based steps at which the alarm fired."""
    return [i + 1 for i, r in enumerate(rewards) if detector.update(r).alarm]


def test_alarm_fires_once_when_a_converged_run_loses_its_reward():
    rise = [0.02] * 10 + [0.1, 0.3, 0.6, 0.9] + [1.0] * 20
    fall = [0.05] * 10
    assert _feed(CollapseDetector(window=3), rise + fall) == [len(rise) + 2]


def test_alarm_stays_quiet_on_a_run_that_keeps_its_reward_or_never_learned():
    rng = random.Random(0)
    learned = (
        [0.02] * 10
        + [min(1.0, 0.1 * k) for k in range(10)]
        + [0.9 + 0.1 * rng.random() for _ in range(60)]
    )
    flat = [0.02 + 0.05 * rng.random() for _ in range(80)]  # gains < min_gain: noise
    assert _feed(CollapseDetector(window=5), learned) == []
    assert _feed(CollapseDetector(window=5), flat) == []


def test_alarm_fires_again_only_after_a_recovery():
    d = CollapseDetector(window=2, drop=0.5, min_gain=0.1)
    rewards = [0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.1, 0.1, math.nan, 0.1]
    assert _feed(d, rewards) == [6, 11]  # (1 + 0) / 2 is the level itself: not below


def test_alarm_level_is_relative_to_the_start_and_the_best():
    d = CollapseDetector(window=1, drop=0.25, min_gain=0.0)
    for r in (2.0, 10.0):  # a reward that is not in [0, 1]
        d.update(r)
    assert d.level == pytest.approx(8.0)
    assert not d.update(8.5).alarm
    assert d.update(7.9).alarm


def test_forget_recent_needs_a_full_window_again():
    d = CollapseDetector(window=3, min_gain=0.1)
    for r in (0.0, 0.0, 0.0, 1.0, 1.0, 1.0):
        d.update(r)
    d.forget_recent()
    assert math.isnan(d.update(0.0).mean)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("collapse_window", 0),
        ("collapse_drop", 0.0),
        ("collapse_drop", 1.5),
        ("collapse_lr_factor", 1.0),
        ("collapse_min_gain", -0.1),
        ("beta", -0.01),
        ("scale_rewards", "std"),
        ("loss_type", "token"),
        ("collapse_action", "rollback_now"),
        ("adam_beta1", 1.0),
        ("adam_beta2", -0.1),
        ("adam_epsilon", 0.0),
    ],
)
def test_bad_stability_config_names_the_field(field, value):
    with pytest.raises(ConfigError, match=f"trainer.{field}="):
        TrainerConfig(**{field: value})


# ---- through Trainer.step -----------------------------------------------------------------


def _trainer(model_dir, **overrides) -> Trainer:
    cfg = dict(learning_rate=5e-3, token_budget=48, max_steps=50, dtype="float32")
    cfg |= overrides
    return Trainer(
        model_dir, lora=LoraConfig(r=2, alpha=4.0), trainer=TrainerConfig(**cfg), device="cpu"
    )


def _on_policy(trainer: Trainer, samples):
    logps = trainer.logprobs(samples)
    return [dataclasses.replace(s, logprobs=lp) for s, lp in zip(samples, logps, strict=True)]


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_loss_type_through_the_trainer(tiny_model_dir, loss_type):
    """On-policy, every token's loss is -A of its sample: the step's loss is the naive mean
    of the loss type over several micro-batches."""
    trainer = _trainer(tiny_model_dir, loss_type=loss_type, collapse_action="off")
    trainer.max_completion_length = 12
    samples = _on_policy(trainer, make_samples(10, seed=5))
    metrics = trainer.step(samples)
    assert metrics["batch/microbatches_per_step"] > 1
    by_seq = [[-s.advantage] * len(s.completion_ids) for s in samples]
    assert metrics["loss"] == pytest.approx(_naive_loss(loss_type, by_seq, 12), abs=1e-5)


def test_scale_rewards_reaches_the_loss(tiny_model_dir):
    """With scale_rewards=none the trainer trains on r - mean, not the rollout's advantage."""
    trainer = _trainer(tiny_model_dir, scale_rewards="none", loss_type="grpo")
    samples = make_samples(8, seed=2)
    rewards = [1.0, 1.0, 1.0, 0.97, 0.2, 0.4, 0.6, 0.8]
    ids = ["a"] * 4 + ["b"] * 4
    advs = _rollout_advantages(rewards, ids)
    samples = [
        dataclasses.replace(s, reward=r, group_id=g, advantage=a)
        for s, r, g, a in zip(samples, rewards, ids, advs, strict=True)
    ]
    metrics = trainer.step(_on_policy(trainer, samples))
    centred = _naive(rewards, ids, "none")
    assert metrics["loss"] == pytest.approx(-statistics.fmean(centred), abs=1e-6)
    assert metrics["advantages/abs_max"] == pytest.approx(max(map(abs, centred)))


def test_kl_penalty_is_zero_at_the_base_model_and_grows(tiny_model_dir):
    trainer = _trainer(tiny_model_dir, beta=0.1, learning_rate=2e-2)
    samples = _on_policy(trainer, make_samples(8, seed=1))
    first = trainer.step(samples)
    assert first["kl_ref"] == pytest.approx(0.0, abs=1e-7)  # lora_B starts at 0: the base model
    later = [trainer.step(samples)["kl_ref"] for _ in range(3)]
    assert later[-1] > 1e-5


def _reward_samples(trainer: Trainer, reward: float):
    samples = make_samples(8, seed=3)
    samples = [
        dataclasses.replace(s, reward=reward, group_id=f"g{i % 2}") for i, s in enumerate(samples)
    ]
    return _on_policy(trainer, samples)


def _lora(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


def test_rollback_restores_the_best_steps_adapter_and_lowers_the_lr(tiny_model_dir, caplog):
    trainer = _trainer(
        tiny_model_dir,
        collapse_action="rollback",
        collapse_window=2,
        collapse_lr_factor=0.5,
        learning_rate=1e-2,
    )
    adapters = []
    for r in (0.0, 0.0, 1.0, 1.0):
        trainer.step(_reward_samples(trainer, r))
        adapters.append(_lora(trainer))
    best = adapters[-1]  # the step that set the best moving mean
    caplog.clear()
    with caplog.at_level("WARNING"):
        ok = trainer.step(_reward_samples(trainer, 1.0))  # no new best: same mean
        assert ok["collapse/alarm"] == 0.0
        trainer.step(_reward_samples(trainer, 0.0))  # mean 0.5: not below 0.5
        fired = trainer.step(_reward_samples(trainer, 0.0))
    assert fired["collapse/alarm"] == 1.0
    assert [r.message for r in caplog.records if "collapse alarm" in r.message] != []
    assert len([r for r in caplog.records if "collapse alarm" in r.message]) == 1
    after = _lora(trainer)
    assert all(torch.equal(after[k], best[k]) for k in best)
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(5e-3)
    assert trainer.step_count == 7  # the count goes on: versions and schedule stay monotonic


def test_stop_action_requests_the_end_and_warn_only_logs(tiny_model_dir, caplog):
    for action in ("stop", "warn"):
        trainer = _trainer(tiny_model_dir, collapse_action=action, collapse_window=1)
        with caplog.at_level("WARNING"):
            for r in (0.0, 1.0, 0.0):
                metrics = trainer.step(_reward_samples(trainer, r))
        assert metrics["collapse/alarm"] == 1.0
        assert trainer.stop_requested == (action == "stop")


def test_rollback_restores_the_version_that_earned_the_best_reward(tiny_model_dir, tmp_path):
    """Samples two versions old: the best moving mean is the reward of the version that
    sampled it, so the rollback restores that version as published, not the adapter the
    trainer had when it saw the reward (with stale samples that one may already be broken)."""
    trainer = _trainer(
        tiny_model_dir,
        collapse_action="rollback",
        collapse_window=2,
        collapse_lr_factor=0.5,
        learning_rate=1e-2,
        max_staleness=2,
    )
    published, current = {}, {}
    for step, r in enumerate((0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0)):
        trainer.save_adapter(tmp_path / f"v{step}", version=step)
        published[step] = _lora(trainer)
        samples = [
            dataclasses.replace(s, version=max(0, step - 2)) for s in _reward_samples(trainer, r)
        ]
        metrics = trainer.step(samples)
        current[step] = _lora(trainer)
    assert metrics["collapse/alarm"] == 1.0
    # the best mean (1.0) first came at step 3, on samples of version 1
    after = _lora(trainer)
    assert all(torch.equal(after[k], published[1][k]) for k in after)
    assert not all(torch.equal(after[k], current[3][k]) for k in after)
    assert len(trainer.collapse.snapshots) == 3  # max_staleness + 1 versions kept
