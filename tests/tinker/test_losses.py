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
    loss = token_loss(
        "importance_sampling", LOGP, {"logprobs": Q, "advantages": ADV, "target_tokens": TARGETS}
    )
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
    token_loss(
        "importance_sampling", logp, {"logprobs": Q, "advantages": ADV, "target_tokens": TARGETS}
    ).sum().backward()
    assert logp.grad is not None
    assert logp.grad.tolist() == pytest.approx((-torch.exp(LOGP - Q) * ADV).tolist(), rel=1e-6)


def _grad(name: str, logp: torch.Tensor, inputs: dict, config: dict | None = None) -> list:
    logp = logp.clone().requires_grad_(True)
    token_loss(name, logp, inputs, config).sum().backward()
    assert logp.grad is not None
    return logp.grad.tolist()


# logp is -1 everywhere and q is set so that the ratios are 0.5, 2, 2 and 0.5
LOGP1 = torch.full((4,), -1.0)
Q_RATIOS = torch.tensor(
    [-1 + math.log(2.0), -1 - math.log(2.0), -1 - math.log(2.0), -1 + math.log(2.0)]
)
ADV_PM = torch.tensor([1.0, 1.0, -1.0, -1.0])


def test_cispo_weights_logp_by_the_clipped_detached_ratio() -> None:
    inputs = {"logprobs": Q_RATIOS, "advantages": ADV_PM, "target_tokens": TARGETS[:1].repeat(4)}
    # clip(0.5, 2, 2, 0.5) = 0.8, 1.2, 1.2, 0.8; loss = -w * logp * A = w * A
    assert token_loss("cispo", LOGP1, inputs).tolist() == pytest.approx([0.8, 1.2, -1.2, -0.8])
    # the weight is a constant: d/dlogp = -w * A (importance_sampling's would be -r * A)
    assert _grad("cispo", LOGP1, inputs) == pytest.approx([-0.8, -1.2, 1.2, 0.8])
    wider = {"clip_low_threshold": 0.25, "clip_high_threshold": 4.0}
    assert token_loss("cispo", LOGP1, inputs, wider).tolist() == pytest.approx([0.5, 2, -2, -0.5])


def test_dro_is_reward_minus_a_quadratic_penalty() -> None:
    logp, q, adv = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -2.0]), torch.tensor([1.0, -1.0])
    inputs = {"logprobs": q, "advantages": adv, "target_tokens": TARGETS[:2]}
    # -(logp A - beta/2 (logp - q)^2): beta 0.05 -> 1 + 0.025 * 0.25, then -2
    assert token_loss("dro", logp, inputs).tolist() == pytest.approx([1.00625, -2.0])
    assert token_loss("dro", logp, inputs, {"beta": 2.0}).tolist() == pytest.approx([1.25, -2.0])
    # d/dlogp = -(A - beta (logp - q)) = -(1 - 2 * 0.5), -(-1 - 0)
    assert _grad("dro", logp, inputs, {"beta": 2.0}) == pytest.approx([0.0, 1.0])


def test_gspo_gives_every_token_the_sequence_ratio_and_its_own_gradient() -> None:
    logp = torch.full((3,), -1.0)
    q = torch.tensor([-1 - math.log(2.0), -1.0, -1 + math.log(2.0)])
    inputs = {
        "logprobs": q,
        "advantages": torch.tensor([1.0, 1.0, -1.0]),
        "sequence_ratio_mask": torch.tensor([0.0, 1.0, 1.0]),
        "target_tokens": TARGETS,
    }
    # log ratios ln2, 0, -ln2; over the mask (positions 1, 2) their mean is -ln2/2: s = 2^-0.5
    s = 2**-0.5
    # A = 1: -min(s, clip(s)=0.8) = -s; A = -1: -min(-s, -0.8) = 0.8 (clipped)
    assert token_loss("gspo", logp, inputs).tolist() == pytest.approx([-s, -s, 0.8], rel=1e-6)
    # each token's ratio has its own logprob's gradient, s; the clipped one has none
    assert _grad("gspo", logp, inputs) == pytest.approx([-s, -s, 0.0], rel=1e-6)


def test_stable_reinforce_is_importance_sampling_plus_the_trust_term_on_sampled_tokens() -> None:
    logp = torch.tensor([-1.0, -2.0, -0.5])
    q = torch.tensor([-1.2, -2.0, -0.9])
    inputs = {
        "logprobs": q,
        "advantages": torch.tensor([1.0, 0.0, 0.0]),
        "trained": torch.tensor([1.0, 1.0, 0.0]),
        "target_tokens": TARGETS,
    }
    r0 = math.exp(0.2)
    assert token_loss("stable_reinforce", logp, inputs).tolist() == pytest.approx([-r0, 0, 0])
    # kl_coeff 0.5: + 0.25 * (logp - q)^2 where sampled: 0.25 * 0.04 at 0; 0 at 1; not at 2
    with_kl = token_loss("stable_reinforce", logp, inputs, {"kl_coeff": 0.5}).tolist()
    assert with_kl == pytest.approx([-r0 + 0.01, 0.0, 0.0], rel=1e-6)
    # d/dlogp = -r A + kl_coeff (logp - q) on sampled positions
    grad = _grad("stable_reinforce", logp, inputs, {"kl_coeff": 0.5})
    assert grad == pytest.approx([-r0 + 0.5 * 0.2, 0.0, 0.0], rel=1e-6)


def test_ppo_takes_the_same_trust_term_with_kl_coeff() -> None:
    logp = torch.tensor([-1.0, -2.0])
    inputs = {
        "logprobs": torch.tensor([-1.1, -1.0]),
        "advantages": torch.tensor([1.0, 0.0]),
        "target_tokens": TARGETS[:2],
    }
    plain = token_loss("ppo", logp, inputs).tolist()
    assert plain == pytest.approx([-math.exp(0.1), 0.0], rel=1e-6)
    # without provenance the trained positions are those with an advantage: position 1 has
    # none, so its large gap (-2 vs -1) adds nothing
    kl = token_loss("ppo", logp, inputs, {"kl_coeff": 2.0}).tolist()
    assert kl == pytest.approx([-math.exp(0.1) + 0.01, 0.0], rel=1e-6)


def test_the_sampler_gap_is_the_cookbooks_kl_estimate_on_trained_tokens() -> None:
    import numpy as np

    from asyncgrpo.tinker.losses import sampler_gap

    inputs = [
        {"logprobs": np.array([0.0, -1.0, -2.0]), "advantages": np.array([0.0, 1.0, 1.0])},
        {"logprobs": np.array([-0.5]), "advantages": np.array([0.0])},
    ]
    trained = [None, np.array([1.0])]
    logprobs = [np.array([-9.0, -1.5, -1.0]), np.array([-0.7])]
    gap = sampler_gap("importance_sampling", inputs, trained, logprobs)
    # diffs q - logp on trained positions: 0.5, -1.0 (datum 0), 0.2 (datum 1)
    assert gap.count == 3
    metrics = gap.metrics()
    assert metrics["kl_sample_train_v1:mean"] == pytest.approx((0.5 - 1.0 + 0.2) / 3)
    assert metrics["kl_sample_train_v2:mean"] == pytest.approx(0.5 * (0.25 + 1 + 0.04) / 3)
    assert sampler_gap("cross_entropy", inputs, trained, logprobs).metrics() == {}


@pytest.mark.parametrize(
    ("name", "config", "fragment"),
    [
        ("custom", None, "forward_backward_custom"),
        ("nope", None, "use one of cross_entropy, importance_sampling, ppo, cispo, dro, gspo"),
        ("ppo", {"clip_epsilon": 0.1}, "reads: clip_low_threshold, clip_high_threshold, kl_coeff"),
        ("cross_entropy", {"clip_low_threshold": 0.1}, "reads: none"),
        ("stable_reinforce", {"kl_coeff": -1.0}, "give a number >= 0"),
        ("cispo", {"clip_low_threshold": 1.5, "clip_high_threshold": 1.2}, "0 <= low <= high"),
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
