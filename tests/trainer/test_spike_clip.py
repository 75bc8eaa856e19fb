"""Gradient-norm clipping against the run's own recent norms (``trainer.spike_clip_z``): the
statistics as pure logic, and through ``Trainer.step`` against the same step clipped by hand."""

from __future__ import annotations

import dataclasses
import math
import statistics

import pytest
import torch
from trainer_helpers import make_samples

from asyncgrpo.config.trainer import LoraConfig, TrainerConfig
from asyncgrpo.errors import ConfigError
from asyncgrpo.trainer.loop import Trainer
from asyncgrpo.trainer.spike_clip import SpikeClip


def test_warmup_only_seeds_the_statistics():
    clip = SpikeClip(2.0, warmup=3)
    assert [clip.factor(n) for n in (1.0, 2.0, 30.0)] == [1.0, 1.0, 1.0]
    assert clip.mean == pytest.approx(11.0)
    assert clip.var == pytest.approx(statistics.pvariance([1.0, 2.0, 30.0]))
    assert clip.threshold() == pytest.approx(11.0 + 2.0 * statistics.pstdev([1.0, 2.0, 30.0]))


def test_a_spike_is_clipped_to_mean_plus_z_std_and_counted_clipped():
    clip = SpikeClip(2.5, decay=0.9, warmup=4)
    for n in (0.9, 1.1, 0.9, 1.1):  # mean 1, std 0.1
        clip.factor(n)
    assert clip.threshold() == pytest.approx(1.25)
    assert clip.factor(1.2) == 1.0  # within: let through, and averaged in as it is
    mean = 0.9 * 1.0 + 0.1 * 1.2
    var = 0.9 * 0.01 + 0.1 * (1.2 - mean) ** 2
    assert (clip.mean, clip.var) == pytest.approx((mean, var))
    level = mean + 2.5 * math.sqrt(var)
    assert clip.factor(100.0) == pytest.approx(level / 100.0)
    want = 0.9 * mean + 0.1 * level  # the clipped norm, not the spike's 100
    assert clip.mean == pytest.approx(want)
    assert clip.var == pytest.approx(0.9 * var + 0.1 * (level - want) ** 2)


@pytest.mark.parametrize("skipped", [0.0, math.nan, math.inf])
def test_zero_and_non_finite_norms_leave_the_statistics_alone(skipped):
    clip = SpikeClip(2.0, warmup=2)
    clip.factor(1.0)
    assert clip.factor(skipped) == 1.0 and not clip.ready  # not counted in the warm-up
    clip.factor(3.0)
    state = clip.state_dict()
    for _ in range(50):  # a long converged stretch does not drag the level to 0
        assert clip.factor(skipped) == 1.0
    assert clip.state_dict() == state
    assert clip.factor(2.5) == 1.0


def test_state_round_trips():
    clip = SpikeClip(3.0, warmup=2)
    for n in (1.0, 2.0, 1.5, 9.0):
        clip.factor(n)
    again = SpikeClip(3.0, warmup=2)
    again.load_state_dict(clip.state_dict())
    assert again.factor(20.0) == clip.factor(20.0) and again.state_dict() == clip.state_dict()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("spike_clip_z", 0.0),
        ("spike_clip_z", -1.0),
        ("spike_clip_z", math.nan),
        ("spike_clip_decay", 1.0),
        ("spike_clip_decay", 0.0),
        ("spike_clip_warmup", 0),
    ],
)
def test_bad_spike_clip_settings_name_the_field(field, value):
    with pytest.raises(ConfigError, match=rf"trainer\.{field}="):
        TrainerConfig(**{field: value})


def _trainer(model_dir, **overrides) -> Trainer:
    cfg = TrainerConfig(
        learning_rate=1e-3, token_budget=64, dtype="float32", max_grad_norm=None, **overrides
    )
    return Trainer(model_dir, lora=LoraConfig(r=2, alpha=4.0), trainer=cfg, device="cpu")


def test_trainer_step_clips_a_spike_to_the_level_of_its_history(tiny_model_dir):
    """After three ordinary steps, one with advantages 1000x as large: with spike_clip_z its
    gradient is cut to mean + z * std of the norms before it, exactly as max_grad_norm at that
    level would cut it; without, the step is another one."""
    samples = make_samples(8, seed=1)
    spike = [dataclasses.replace(s, advantage=s.advantage * 1000) for s in samples]
    clipped = _trainer(tiny_model_dir, spike_clip_z=2.0, spike_clip_warmup=3)
    by_hand, free = _trainer(tiny_model_dir), _trainer(tiny_model_dir)
    mirror = SpikeClip(2.0, warmup=3)
    for _ in range(3):  # the warm-up: all three take the same steps
        metrics = clipped.step(samples)
        assert metrics["collapse/spike_clip"] == 1.0
        mirror.factor(metrics["grad_norm"])
        by_hand.step(samples)
        free.step(samples)
    assert "collapse/spike_clip" not in free.step(spike)
    level = mirror.threshold()
    by_hand.clip.max_norm = level  # max_grad_norm=level from here on
    metrics = clipped.step(spike)
    by_hand.step(spike)
    assert metrics["grad_norm"] > 100 * level
    assert metrics["collapse/spike_clip"] == pytest.approx(level / metrics["grad_norm"])
    for a, b in zip(clipped.params, by_hand.params, strict=True):
        torch.testing.assert_close(a, b)
    assert not all(torch.allclose(a, c) for a, c in zip(clipped.params, free.params, strict=True))
    assert clipped.state_dict()["spike_clip"]["mean"] == pytest.approx(
        0.97 * mirror.mean + 0.03 * level
    )


def test_the_statistics_resume_from_a_checkpoint(tiny_model_dir, tmp_path):
    """A resumed run judges the next spike by the norms it had seen, not from a fresh warm-up."""
    trainer = _trainer(tiny_model_dir, spike_clip_z=2.0, spike_clip_warmup=2)
    for seed in (1, 2, 3):
        trainer.step(make_samples(8, seed=seed))
    trainer.save_checkpoint(tmp_path / "ckpt")
    resumed = _trainer(tiny_model_dir, spike_clip_z=2.0, spike_clip_warmup=2)
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert resumed.spike_clip is not None and trainer.spike_clip is not None
    assert resumed.spike_clip.ready
    assert resumed.spike_clip.state_dict() == trainer.spike_clip.state_dict()
