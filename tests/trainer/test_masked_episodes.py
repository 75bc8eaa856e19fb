"""Multi-turn samples in the trainer: environment tokens carry no loss, count nowhere in the
normalisation, and are still packed padding-free; every token keeps its own version."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from trainer_helpers import VOCAB, make_samples

from asyncgrpo.config.trainer import LoraConfig, TrainerConfig
from asyncgrpo.sample import Sample
from asyncgrpo.trainer.loop import Trainer
from asyncgrpo.trainer.packing import build_row


def multi_turn(samples: list[Sample], seed: int = 0) -> list[Sample]:
    """Each sample's completion split into model turns with environment tokens between them;
    the later turns one version newer (an episode that spans a weight sync)."""
    rng = random.Random(seed)
    out = []
    for s in samples:
        ids, lps, mask, versions = [], [], [], []
        for turn in range(3):
            n = rng.randint(1, 6)
            ids += [rng.randrange(VOCAB) for _ in range(n)]
            lps += [-rng.uniform(3.0, 9.0) for _ in range(n)]
            mask += [True] * n
            versions += [s.version + (turn > 0)] * n
            if turn < 2:
                e = rng.randint(2, 5)
                ids += [rng.randrange(VOCAB) for _ in range(e)]
                lps += [0.0] * e
                mask += [False] * e
                versions += [s.version + (turn > 0)] * e
        out.append(
            dataclasses.replace(
                s, completion_ids=ids, logprobs=lps, completion_mask=mask, versions=versions
            )
        )
    return out


def _trainer(model_dir) -> Trainer:
    cfg = TrainerConfig(
        learning_rate=5e-3, token_budget=4096, max_grad_norm=None, dtype="float32", max_staleness=4
    )
    return Trainer(model_dir, lora=LoraConfig(r=4, alpha=8.0), trainer=cfg, seed=0, device="cpu")


def _step_grads(trainer: Trainer, samples: list[Sample]) -> tuple[list[torch.Tensor], dict]:
    grads: list[torch.Tensor] = []
    trainer.optimizer.step = lambda: grads.extend(p.grad.clone() for p in trainer.params)
    metrics = trainer.step(samples)
    return grads, metrics


def test_packed_rows_mask_environment_tokens_and_carry_token_versions() -> None:
    samples = multi_turn(make_samples(3, seed=4, version=2))
    row = build_row(samples, [0, 1, 2])
    mask, versions, advs = [], [], []
    for s in samples:
        p = len(s.prompt_ids)
        mask += [False] * p + s.policy_mask()
        versions += [s.version] * p + s.token_versions()
        advs += [0.0] * p + [s.advantage if m else 0.0 for m in s.policy_mask()]
    assert row.completion_mask.tolist() == mask
    assert row.versions.tolist() == versions
    assert row.advantages.tolist() == pytest.approx(advs)
    assert row.num_tokens == sum(s.num_tokens for s in samples)  # still padding-free
    assert row.num_completion_tokens == sum(s.num_policy_tokens for s in samples)


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
def test_environment_tokens_get_exactly_zero_gradient(tiny_model_dir) -> None:
    """Whatever an environment token's logprob or advantage bookkeeping says, the gradient is
    bit-identical: its loss term does not exist. The LM head never even scores it."""
    samples = multi_turn(make_samples(8, seed=5))
    scrambled = [
        dataclasses.replace(
            s,
            logprobs=[
                lp if m else -40.0 for lp, m in zip(s.logprobs, s.policy_mask(), strict=True)
            ],
        )
        for s in samples
    ]
    a, b = _trainer(tiny_model_dir), _trainer(tiny_model_dir)
    scored: list[int] = []
    head = a.model.get_output_embeddings()
    handle = head.register_forward_hook(lambda m, i, o: scored.append(o.shape[1]))
    grads_a, metrics = _step_grads(a, samples)
    handle.remove()
    grads_b, _ = _step_grads(b, scrambled)
    assert any(float(g.abs().max()) > 0 for g in grads_a)
    for ga, gb in zip(grads_a, grads_b, strict=True):
        assert torch.equal(ga, gb)
    policy_tokens = sum(s.num_policy_tokens for s in samples)
    assert sum(scored) == policy_tokens
    assert metrics["batch/completion_tokens"] == policy_tokens  # the normaliser


def test_loss_equals_the_policy_tokens_only_loss(tiny_model_dir) -> None:
    """The step's loss and gradient are those of a batch that holds only the policy tokens'
    terms: the same sequences, each policy token's loss divided by the policy-token count."""
    samples = multi_turn(make_samples(6, seed=6))
    trainer = _trainer(tiny_model_dir)
    logps = trainer.logprobs(samples)
    for s, lp in zip(samples, logps, strict=True):
        assert len(lp) == len(s.completion_ids)
        assert all(v == 0.0 for v, m in zip(lp, s.policy_mask(), strict=True) if not m)
    # On-policy behaviour logprobs: ratio 1 on every policy token, so loss = -mean(A) over them.
    on_policy = [dataclasses.replace(s, logprobs=lp) for s, lp in zip(samples, logps, strict=True)]
    metrics = trainer.step(on_policy)
    n = sum(s.num_policy_tokens for s in samples)
    expected = -sum(s.advantage * s.num_policy_tokens for s in samples) / n
    assert metrics["loss"] == pytest.approx(expected, abs=1e-5)
    assert metrics["ratio"] == pytest.approx(1.0, abs=1e-5)
