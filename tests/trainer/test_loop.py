"""Trainer: learning on a fixed batch, normalisation across micro-batches, checkpoint round trip."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from trainer_helpers import make_samples

from asyncgrpo.config.trainer import LoraConfig, TrainerConfig
from asyncgrpo.trainer.loop import Trainer, lr_factor


def _trainer(model_dir, seed: int = 0, **overrides) -> Trainer:
    cfg = dict(learning_rate=5e-3, token_budget=128, max_steps=20, epsilon=0.2, dtype="float32")
    cfg.update(overrides)
    return Trainer(
        model_dir,
        lora=LoraConfig(r=4, alpha=8.0),
        trainer=TrainerConfig(**cfg),
        seed=seed,
        device="cpu",
    )


def _on_policy(trainer: Trainer, samples):
    """Give the samples the trainer's own logprobs as behaviour logprobs (ratio starts at 1)."""
    logps = trainer.logprobs(samples)
    return [dataclasses.replace(s, logprobs=lp) for s, lp in zip(samples, logps, strict=True)]


def _lora(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


def test_steps_change_adapter_and_reduce_loss(tiny_model_dir):
    trainer = _trainer(tiny_model_dir)
    samples = _on_policy(trainer, make_samples(16, seed=1, temperature=0.7))
    before = _lora(trainer)
    assert all(float(v.abs().sum()) == 0 for k, v in before.items() if "lora_B" in k)

    history = [trainer.step(samples) for _ in range(6)]
    first, last = history[0], history[-1]
    # Behaviour logprobs are the policy's own: the first ratio is 1 to float precision.
    assert first["ratio"] == pytest.approx(1.0, abs=1e-5)
    assert first["kl"] == pytest.approx(0.0, abs=1e-6)
    assert first["clip_ratio/region_mean"] == 0.0
    assert last["loss"] < first["loss"] - 0.05
    assert last["ratio"] != pytest.approx(1.0, abs=1e-3)
    after = _lora(trainer)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert trainer.step_count == 6
    for key in (
        "perf/fwd_bwd_s",
        "perf/fwd_s",
        "batch/samples_per_row",
        "batch/microbatches_per_step",
        "entropy",
        "clip_ratio/low_mean",
        "clip_ratio/high_mean",
        "reward",
        "reward_std",
    ):
        assert math.isfinite(first[key]), key
    assert first["perf/fwd_s"] < first["perf/fwd_bwd_s"]
    assert first["batch/microbatches_per_step"] < 16  # packed: several samples per row


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
def test_gradient_is_independent_of_row_split(tiny_model_dir):
    """Token-level normalisation over the step: packed rows and one-sample rows agree."""
    packed = _trainer(tiny_model_dir, token_budget=4096, max_grad_norm=1e6)  # clip: a no-op
    single = _trainer(
        tiny_model_dir, token_budget=None, gradient_accumulation_steps=12, max_grad_norm=None
    )
    grads = {}
    for name, t in (("packed", packed), ("single", single)):
        # Capture the accumulated gradient just before AdamW consumes it.
        t.optimizer.step = lambda name=name, t=t: grads.__setitem__(
            name, [p.grad.clone() for p in t.params]
        )
    samples = make_samples(12, seed=2)
    m_packed = packed.step(samples)
    m_single = single.step(samples)
    assert m_packed["batch/microbatches_per_step"] == 1
    assert m_single["batch/microbatches_per_step"] == 12
    assert m_packed["loss"] == pytest.approx(m_single["loss"], abs=1e-6)
    assert m_packed["grad_norm"] == pytest.approx(m_single["grad_norm"], rel=1e-4)
    assert any(float(g.abs().max()) > 1e-4 for g in grads["packed"])
    for a, b in zip(grads["packed"], grads["single"], strict=True):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-7)


def test_checkpoint_round_trip_restores_identical_state(tiny_model_dir, tmp_path):
    batches = [make_samples(8, seed=10 + i) for i in range(3)]
    trainer = _trainer(tiny_model_dir, lr_schedule="cosine", warmup_steps=1, max_steps=5)
    trainer.step(batches[0])
    trainer.step(batches[1])
    trainer.save_checkpoint(tmp_path / "ckpt", extra={"version": 7})
    expected = trainer.step(batches[2])
    expected_params = _lora(trainer)
    expected_rng = torch.rand(3)

    resumed = _trainer(tiny_model_dir, lr_schedule="cosine", warmup_steps=1, max_steps=5, seed=1)
    assert resumed.load_checkpoint(tmp_path / "ckpt") == {"version": 7}
    assert resumed.step_count == 2
    got = resumed.step(batches[2])
    assert got["loss"] == expected["loss"]
    assert got["learning_rate"] == expected["learning_rate"]
    params = _lora(resumed)
    assert all(torch.equal(params[k], expected_params[k]) for k in params)
    assert torch.equal(torch.rand(3), expected_rng)


def test_checkpoint_rejects_other_lora_config(tiny_model_dir, tmp_path):
    _trainer(tiny_model_dir).save_checkpoint(tmp_path)
    other = Trainer(
        tiny_model_dir,
        lora=LoraConfig(r=4, alpha=8.0, target_modules=["q_proj"]),
        trainer=TrainerConfig(dtype="float32"),
        device="cpu",
    )
    with pytest.raises(ValueError, match="same lora settings"):
        other.load_checkpoint(tmp_path)


def test_save_adapter_writes_peft_files(tiny_model_dir, tmp_path):
    trainer = _trainer(tiny_model_dir)
    out = trainer.save_adapter(tmp_path / "v1")
    assert (out / "adapter_model.safetensors").is_file()
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == 4
    assert config["lora_alpha"] == 8.0


def _naive_lr_factor(step, schedule, warmup, max_steps):
    if step < warmup:
        return (step + 1) / (warmup + 1)
    p = (step - warmup) / max(1, max_steps - warmup)
    p = min(p, 1.0)
    return {"constant": 1.0, "linear": 1 - p, "cosine": (1 + math.cos(math.pi * p)) / 2}[schedule]


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
def test_lr_factor(schedule):
    for step in range(12):
        got = lr_factor(step, schedule=schedule, warmup_steps=3, max_steps=10)
        assert got == pytest.approx(_naive_lr_factor(step, schedule, 3, 10))
    assert lr_factor(0, schedule=schedule, warmup_steps=3, max_steps=10) > 0
    assert lr_factor(3, schedule=schedule, warmup_steps=3, max_steps=10) == 1.0


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
def test_gradient_checkpointing_gives_the_same_gradient(tiny_model_dir):
    plain = _trainer(tiny_model_dir)
    ckpt = _trainer(tiny_model_dir, gradient_checkpointing=True)
    assert ckpt.model.base_model.model.is_gradient_checkpointing
    grads = {}
    for name, t in (("plain", plain), ("ckpt", ckpt)):
        t.optimizer.step = lambda name=name, t=t: grads.__setitem__(
            name, [p.grad.clone() for p in t.params]
        )
    samples = make_samples(6, seed=4)
    assert plain.step(samples)["loss"] == pytest.approx(ckpt.step(samples)["loss"], abs=1e-7)
    for a, b in zip(grads["plain"], grads["ckpt"], strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-8)


def test_non_finite_gradient_skips_the_update(tiny_model_dir, caplog):
    # unless a masking correction (mis_*) drops it (tests/trainer/test_loss.py), a NaN
    # behaviour logprob poisons the gradient
    trainer = _trainer(tiny_model_dir, off_policy="none")
    samples = make_samples(4, seed=5)
    samples[0].logprobs[0] = math.nan
    before = _lora(trainer)
    metrics = trainer.step(samples)
    assert math.isnan(metrics["grad_norm"])
    assert "update skipped" in caplog.text
    after = _lora(trainer)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert trainer.step_count == 1


def test_perf_metrics_mfu_and_peak_memory(tiny_model_dir):
    from asyncgrpo.trainer.flops import step_flops
    from asyncgrpo.trainer.packing import pack_samples

    trainer = _trainer(tiny_model_dir, peak_flops=1e12, token_budget=64)
    samples = make_samples(10, seed=4)
    m = trainer.step(samples)
    rows = pack_samples(samples, token_budget=64)
    flops = step_flops(
        trainer.shape,
        [n for r in rows for n in r.seq_lens],
        sum(len(s.completion_ids) for s in samples),
    )
    assert m["perf/mfu"] == pytest.approx(flops / m["perf/fwd_bwd_s"] / 1e12)
    assert 0 < m["perf/mfu"] < 1
    assert m["perf/tokens_per_s"] == pytest.approx(m["batch/tokens"] / m["perf/fwd_bwd_s"])
    assert m["perf/peak_mem_gib"] > 0
    assert "perf/mfu" not in _trainer(tiny_model_dir).step(samples)  # no peak_flops, no MFU


def test_bfloat16_base_trains_a_float32_adapter_under_autocast(tiny_model_dir):
    samples = make_samples(6, seed=5)
    ref = _trainer(tiny_model_dir)
    half = _trainer(tiny_model_dir, dtype="bfloat16")
    base = [p for n, p in half.model.named_parameters() if "lora_" not in n]
    assert {p.dtype for p in base} == {torch.bfloat16}
    assert {p.dtype for p in half.params} == {torch.float32}
    # the bfloat16 policy's logprobs are the float32 one's, to bfloat16 precision
    got = [x for lp in half.logprobs(samples) for x in lp]
    want = [x for lp in ref.logprobs(samples) for x in lp]
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 0.1
    before = {k: v.clone() for k, v in _lora(half).items()}
    m = half.step(samples)
    assert math.isfinite(m["loss"]) and m["grad_norm"] > 0
    after = _lora(half)
    assert all(after[k].dtype == torch.float32 for k in after)
    assert any(not torch.equal(before[k], after[k]) for k in after)
