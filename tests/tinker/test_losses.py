"""Each built-in loss against a reference computed by hand from the Tinker docs' formula."""

from __future__ import annotations

import math

import pytest
import torch

from asyncgrpo.tinker.losses import LossInputError, check_inputs, check_loss, token_loss

LOGP = torch.tensor([-0.5, -1.0, -2.0])
Q = torch.tensor([-0.6, -0.8, -2.0])
ADV = torch.tensor([1.0, -2.0, 0.5])
TARGETS = torch.tensor([1, 2, 3])


def test_cross_entropy_is_minus_weighted_logprob() -> None:
    weights = torch.tensor([0.0, 1.0, 0.5])
    loss = token_loss("cross_entropy", LOGP, {"target_tokens": TARGETS, "weights": weights})
    assert loss.tolist() == pytest.approx([0.0, 1.0, 1.0])
    unweighted = token_loss("cross_entropy", LOGP, {"target_tokens": TARGETS})
    assert unweighted.sum().item() == pytest.approx(3.5)


def test_importance_sampling_is_minus_ratio_times_advantage() -> None:
    loss = token_loss("importance_sampling", LOGP, {"logprobs": Q, "advantages": ADV,
                                                    "target_tokens": TARGETS})  # fmt: skip
    expected = [-math.exp(0.1) * 1.0, -math.exp(-0.2) * -2.0, -1.0 * 0.5]
    assert loss.tolist() == pytest.approx(expected, rel=1e-6)


def test_ppo_clips_the_ratio_pessimistically() -> None:
    logp = torch.tensor([0.0, 0.0, 0.0, 0.0])
    q = torch.tensor([math.log(2.0), -math.log(2.0), -math.log(2.0), math.log(2.0)])
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    inputs = {"logprobs": q, "advantages": adv, "target_tokens": torch.zeros(4)}
    # ratios 0.5, 2, 2, 0.5: min(rA, clip(r)A) = 0.5, 1.2, -2, -0.8
    assert token_loss("ppo", logp, inputs).tolist() == pytest.approx([-0.5, -1.2, 2.0, 0.8])
    wider = {"clip_low_threshold": 0.4, "clip_high_threshold": 3.0}
    assert token_loss("ppo", logp, inputs, wider).tolist() == pytest.approx([-0.5, -2, 2, 0.5])


def test_gradient_of_importance_sampling_is_minus_ratio_advantage() -> None:
    logp = LOGP.clone().requires_grad_(True)
    token_loss("importance_sampling", logp, {"logprobs": Q, "advantages": ADV,
                                             "target_tokens": TARGETS}).sum().backward()  # fmt: skip
    assert logp.grad is not None
    assert logp.grad.tolist() == pytest.approx((-torch.exp(LOGP - Q) * ADV).tolist(), rel=1e-6)


@pytest.mark.parametrize(
    ("name", "config", "fragment"),
    [
        ("cispo", None, "use one of cross_entropy, importance_sampling, ppo"),
        ("stable_reinforce", None, "stability information"),
        ("ppo", {"clip_epsilon": 0.1}, "reads: clip_low_threshold, clip_high_threshold"),
        ("cross_entropy", {"clip_low_threshold": 0.1}, "reads: none"),
    ],
)
def test_unsupported_losses_and_config_are_refused(name, config, fragment) -> None:
    with pytest.raises(LossInputError, match=fragment):
        check_loss(name, config)


def test_inputs_must_match_the_tokens_and_the_loss() -> None:
    good = {"target_tokens": TARGETS, "logprobs": Q, "advantages": ADV}
    check_inputs("importance_sampling", 3, good, 0)
    with pytest.raises(LossInputError, match=r"datum 2: .*advantages.* shape \[2\].*shape \[3\]"):
        check_inputs("importance_sampling", 3, {**good, "advantages": ADV[:2]}, 2)
    with pytest.raises(LossInputError, match="needs loss_fn_inputs logprobs"):
        check_inputs("ppo", 3, {"target_tokens": TARGETS, "advantages": ADV}, 0)
    with pytest.raises(LossInputError, match="does not read advantages"):
        check_inputs("cross_entropy", 3, {"target_tokens": TARGETS, "advantages": ADV}, 0)
