"""The Tinker API's built-in losses, as pure functions over one ``Datum``'s 1-D tensors.

Every loss takes the current policy's logprobs of the datum's ``target_tokens`` (``logp``, with
grad) and the datum's other ``loss_fn_inputs``, and returns the per-token loss; the datum's
loss is its sum and a request's loss is the sum over its datums (Tinker sums, it does not
average: scale ``weights`` or ``advantages`` to average). With ``q`` the sampler's logprobs
(``logprobs``), ``A`` the ``advantages``, ``r = exp(logp - q)``, ``sg`` a stop-gradient and
``M`` the positions the policy is trained on (``trained``: the sampled tokens a datum's
provenance names, else those with a nonzero advantage)::

    cross_entropy        -weights * logp                                 (weights default to 1)
    importance_sampling  -r A
    ppo                  -min(r A, clip(r, low, high) A)           + kl_coeff/2 (logp - q)^2 on M
    cispo                -sg(clip(r, low, high)) logp A
    dro                  -(logp A - beta/2 (logp - q)^2)
    gspo                 -min(s A, clip(s, low, high) A),  s = sg(exp(mean over sequence_ratio_mask
                          of (logp - q))) * exp(logp - sg(logp))
    stable_reinforce     -r A                                      + kl_coeff/2 (logp - q)^2 on M

``low``/``high`` are ``loss_fn_config``'s ``clip_low_threshold``/``clip_high_threshold``
(default 0.8 and 1.2, Tinker's epsilon 0.2), ``beta`` defaults to 0.05 (the docs' example) and
``kl_coeff`` to 0. ``stable_reinforce``'s ``q`` is not the datum's ``logprobs`` but what the
service recorded when the sequences its provenance names were sampled
(:mod:`asyncgrpo.tinker.provenance`), and its advantages must be zero off the sampled tokens.
Tinker has not published ``stable_reinforce``'s objective; the one here is this service's
reading of what is published (docs/tinker.md says what it rests on). A loss not in
:data:`LOSSES` is refused by :func:`check_loss`, naming the supported ones.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = [
    "LOSSES",
    "LossInputError",
    "LossSpec",
    "SamplerGap",
    "check_inputs",
    "check_loss",
    "sampler_gap",
    "token_loss",
]

PPO_CLIP_LOW = 0.8
PPO_CLIP_HIGH = 1.2
DRO_BETA = 0.05


class LossInputError(ValueError):
    """A loss was asked for that is not supported, or a datum lacks what its loss needs."""


def _clip(config: Mapping[str, float]) -> tuple[float, float]:
    low = float(config.get("clip_low_threshold", PPO_CLIP_LOW))
    high = float(config.get("clip_high_threshold", PPO_CLIP_HIGH))
    return low, high


def _kl_penalty(
    logp: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float]
) -> torch.Tensor | float:
    """``kl_coeff / 2 * (logp - q)^2`` on the trained positions (0 when kl_coeff is 0)."""
    coeff = float(config.get("kl_coeff", 0.0))
    if coeff == 0.0:
        return 0.0
    return 0.5 * coeff * (logp - inputs["logprobs"]) ** 2 * inputs["trained"]


def cross_entropy(
    logp: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float]
) -> torch.Tensor:
    weights = inputs.get("weights")
    return -logp if weights is None else -weights * logp


def importance_sampling(
    logp: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float]
) -> torch.Tensor:
    ratio = torch.exp(logp - inputs["logprobs"])
    return -ratio * inputs["advantages"]


def ppo(
    logp: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float]
) -> torch.Tensor:
    low, high = _clip(config)
    advantages = inputs["advantages"]
    ratio = torch.exp(logp - inputs["logprobs"])
    clipped = torch.clamp(ratio, low, high)
    policy = -torch.minimum(ratio * advantages, clipped * advantages)
    return policy + _kl_penalty(logp, inputs, config)


def cispo(
    logp: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float]
) -> torch.Tensor:
    low, high = _clip(config)
    weight = torch.clamp(torch.exp(logp - inputs["logprobs"]), low, high).detach()
    return -weight * logp * inputs["advantages"]


def dro(
    logp: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float]
) -> torch.Tensor:
    beta = float(config.get("beta", DRO_BETA))
    quadratic = (logp - inputs["logprobs"]) ** 2
    return -(logp * inputs["advantages"] - 0.5 * beta * quadratic)


def gspo(
    logp: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float]
) -> torch.Tensor:
    """GSPO-token: every token carries the sequence ratio's value (the geometric mean of the
    token ratios over ``sequence_ratio_mask``) and its own log-probability's gradient."""
    low, high = _clip(config)
    in_ratio = inputs["sequence_ratio_mask"] != 0
    advantages = inputs["advantages"]
    if not bool(in_ratio.any()):  # no token in the ratio: nothing is trained
        return torch.zeros_like(logp) * logp
    log_ratio = (logp.detach() - inputs["logprobs"])[in_ratio].mean()
    ratio = torch.exp(log_ratio + logp - logp.detach())
    clipped = torch.clamp(ratio, low, high)
    return -torch.minimum(ratio * advantages, clipped * advantages)


def stable_reinforce(
    logp: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float]
) -> torch.Tensor:
    """Importance-corrected REINFORCE against the sampler's recorded logprobs, with the
    optional quadratic trust term ``kl_coeff`` (see the module docstring)."""
    return importance_sampling(logp, inputs, config) + _kl_penalty(logp, inputs, config)


LossFn = Callable[[torch.Tensor, Mapping[str, torch.Tensor], Mapping[str, float]], torch.Tensor]


@dataclass(frozen=True)
class LossSpec:
    """A supported loss: its function, the float ``loss_fn_inputs`` it requires beside
    ``target_tokens``, those it also accepts, the ``loss_fn_config`` keys it reads, and whether
    every datum must carry provenance (its sampler logprobs are the recorded ones)."""

    fn: LossFn
    required: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()
    config: tuple[str, ...] = ()
    provenance: bool = False

    @property
    def reads_sampler(self) -> bool:
        """It compares the policy with the sampler (``logprobs``): its KL metrics mean
        something."""
        return "logprobs" in (*self.required, *self.optional) or self.provenance


_CLIP = ("clip_low_threshold", "clip_high_threshold")
_RL = ("logprobs", "advantages")

#: Each supported loss (Tinker SDK 0.38's ``LossFnType`` but ``custom``, which the SDK runs on
#: the client side over ``forward``).
LOSSES: dict[str, LossSpec] = {
    "cross_entropy": LossSpec(cross_entropy, optional=("weights",)),
    "importance_sampling": LossSpec(importance_sampling, _RL),
    "ppo": LossSpec(ppo, _RL, config=(*_CLIP, "kl_coeff")),
    "cispo": LossSpec(cispo, _RL, config=_CLIP),
    "dro": LossSpec(dro, _RL, config=("beta",)),
    "gspo": LossSpec(gspo, (*_RL, "sequence_ratio_mask"), config=_CLIP),
    # logprobs are accepted (the cookbook sends them) and replaced by the recorded ones
    "stable_reinforce": LossSpec(
        stable_reinforce, ("advantages",), ("logprobs",), config=("kl_coeff",), provenance=True
    ),
}

_WHY_NOT = {
    "custom": "send a custom loss with forward_backward_custom (it runs client-side)",
}


def check_loss(name: str, config: Mapping[str, object] | None) -> LossSpec:
    """The loss ``name``; refused if this service does not compute it, or given a config key
    it would ignore or a value out of range."""
    spec = LOSSES.get(name)
    if spec is None:
        why = f" ({_WHY_NOT[name]})" if name in _WHY_NOT else ""
        raise LossInputError(
            f"loss_fn={name!r} is not supported here{why}; use one of {', '.join(LOSSES)}"
        )
    for key, value in (config or {}).items():
        if key not in spec.config:
            accepted = ", ".join(spec.config) or "none"
            raise LossInputError(
                f"loss_fn_config key {key!r} is not read by {name} (it reads: {accepted})"
            )
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value != value:
            raise LossInputError(f"loss_fn_config[{key!r}]={value!r}: give a number")
        if key in ("kl_coeff", "beta") and value < 0:
            raise LossInputError(f"loss_fn_config[{key!r}]={value!r}: give a number >= 0")
    low, high = _clip({k: float(v) for k, v in (config or {}).items() if k in _CLIP})  # type: ignore[arg-type]
    if not 0 <= low <= high:
        raise LossInputError(
            f"clip_low_threshold={low:g} and clip_high_threshold={high:g}: give "
            "0 <= low <= high (ratios, e.g. 0.8 and 1.2)"
        )
    return spec


def check_inputs(name: str, length: int, inputs: Mapping[str, torch.Tensor], index: int) -> None:
    """Refuse datum ``index`` unless its inputs are what loss ``name`` reads, each one value per
    position of its ``length`` tokens."""
    spec = LOSSES[name]
    allowed = {"target_tokens", *spec.required, *spec.optional}
    missing = [k for k in ("target_tokens", *spec.required) if k not in inputs]
    if missing:
        raise LossInputError(
            f"datum {index}: loss {name} needs loss_fn_inputs {', '.join(missing)}"
        )
    extra = sorted(set(inputs) - allowed)
    if extra:
        raise LossInputError(
            f"datum {index}: loss {name} does not read {', '.join(extra)}; "
            f"it reads {', '.join(sorted(allowed))}"
        )
    for key, tensor in sorted(inputs.items()):
        if tuple(tensor.shape) != (length,):
            raise LossInputError(
                f"datum {index}: loss_fn_inputs[{key!r}] has shape {list(tensor.shape)} but the "
                f"datum has {length} input tokens: give one value per input token (shape "
                f"[{length}])"
            )


def token_loss(
    name: str,
    logp: torch.Tensor,
    inputs: Mapping[str, torch.Tensor],
    config: Mapping[str, float] | None = None,
) -> torch.Tensor:
    """The per-token loss of one datum under loss ``name`` (checked by the callers).
    ``inputs`` may hold ``trained`` (1 on the positions the policy term trains); without it,
    the positions with a nonzero advantage."""
    floats = {k: v.to(logp.dtype) for k, v in inputs.items() if k != "target_tokens"}
    if "trained" not in floats and "advantages" in floats:
        floats["trained"] = (floats["advantages"] != 0).to(logp.dtype)
    return LOSSES[name].fn(logp, floats, config or {})


@dataclass
class SamplerGap:
    """Sums of ``q - logp`` and of its square over trained positions, and their count: the
    cookbook's ``kl_sample_train`` estimates (v1 the mean difference, v2 half the mean
    square), which stay near 0 while the trainer scores what the sampler sampled."""

    diff: float = 0.0
    square: float = 0.0
    count: int = 0

    def add(self, other: SamplerGap) -> None:
        self.diff += other.diff
        self.square += other.square
        self.count += other.count

    def metrics(self) -> dict[str, float]:
        if not self.count:
            return {}
        return {
            "kl_sample_train_v1:mean": self.diff / self.count,
            "kl_sample_train_v2:mean": 0.5 * self.square / self.count,
        }


def sampler_gap(
    loss: str,
    inputs: Sequence[Mapping[str, Any]],
    trained: Sequence[Any],
    logprobs: Sequence[Any],
) -> SamplerGap:
    """The :class:`SamplerGap` of a request's datums (their ``loss_fn_inputs``, ``trained``
    masks or None, and the trainer's logprobs) under ``loss``; empty for a loss that does not
    read the sampler's logprobs."""
    gap = SamplerGap()
    if not LOSSES[loss].reads_sampler:
        return gap
    for datum, mask, logp in zip(inputs, trained, logprobs, strict=True):
        q = np.asarray(datum.get("logprobs", np.zeros(len(logp))), np.float64)
        if mask is None:
            mask = np.asarray(datum.get("advantages", np.zeros(len(logp)))) != 0
        keep = np.asarray(mask) != 0
        diff = q[keep] - np.asarray(logp, np.float64)[keep]
        gap.add(SamplerGap(float(diff.sum()), float((diff**2).sum()), int(keep.sum())))
    return gap
