"""The Tinker API's built-in losses, as pure functions over one ``Datum``'s 1-D tensors.

Every loss takes the current policy's logprobs of the datum's ``target_tokens`` (``logp``, with
grad) and the datum's other ``loss_fn_inputs``, and returns the per-token loss; the datum's
loss is its sum and a request's loss is the sum over its datums (Tinker sums, it does not
average: scale ``weights`` or ``advantages`` to average). With ``q`` the sampler's logprobs
(``logprobs``), ``A`` the ``advantages`` and ``r = exp(logp - q)``::

    cross_entropy        -weights * logp                       (weights default to 1)
    importance_sampling  -r * A
    ppo                  -min(r A, clamp(r, clip_low_threshold, clip_high_threshold) A)

``ppo``'s thresholds come from ``loss_fn_config`` (defaults 0.8 and 1.2, Tinker's epsilon 0.2).
A loss not in :data:`LOSSES` is refused by :func:`check_loss`, naming the supported ones.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

__all__ = ["LOSSES", "LossInputError", "check_inputs", "check_loss", "token_loss"]

PPO_CLIP_LOW = 0.8
PPO_CLIP_HIGH = 1.2


class LossInputError(ValueError):
    """A loss was asked for that is not supported, or a datum lacks what its loss needs."""


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
    low = float(config.get("clip_low_threshold", PPO_CLIP_LOW))
    high = float(config.get("clip_high_threshold", PPO_CLIP_HIGH))
    advantages = inputs["advantages"]
    ratio = torch.exp(logp - inputs["logprobs"])
    clipped = torch.clamp(ratio, low, high)
    return -torch.minimum(ratio * advantages, clipped * advantages)


LossFn = Callable[[torch.Tensor, Mapping[str, torch.Tensor], Mapping[str, float]], torch.Tensor]

#: Each supported loss: its function, the float ``loss_fn_inputs`` it requires beside
#: ``target_tokens``, those it accepts, and the ``loss_fn_config`` keys it reads.
LOSSES: dict[str, tuple[LossFn, tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {
    "cross_entropy": (cross_entropy, (), ("weights",), ()),
    "importance_sampling": (importance_sampling, ("logprobs", "advantages"), (), ()),
    "ppo": (ppo, ("logprobs", "advantages"), (), ("clip_low_threshold", "clip_high_threshold")),
}

_WHY_NOT = {
    "stable_reinforce": "Tinker has not published its objective, only that it reads stability "
    "information recorded at sampling time (record_stability_info, Datum provenance), which "
    "vLLM does not return",
    "custom": "send a custom loss with forward_backward_custom (it runs client-side)",
}


def check_loss(name: str, config: Mapping[str, object] | None) -> None:
    """Refuse a loss this service does not compute, or a config key it would ignore."""
    if name not in LOSSES:
        why = f" ({_WHY_NOT[name]})" if name in _WHY_NOT else ""
        raise LossInputError(
            f"loss_fn={name!r} is not supported here{why}; use one of {', '.join(LOSSES)}"
        )
    known = LOSSES[name][3]
    for key, value in (config or {}).items():
        if key not in known:
            accepted = ", ".join(known) or "none"
            raise LossInputError(f"loss_fn_config key {key!r} is not read by {name} (it reads: "
                                 f"{accepted})")  # fmt: skip
        if not isinstance(value, (int, float)):
            raise LossInputError(f"loss_fn_config[{key!r}]={value!r}: give a number")


def check_inputs(name: str, length: int, inputs: Mapping[str, torch.Tensor], index: int) -> None:
    """Refuse datum ``index`` unless its inputs are what loss ``name`` reads, each one value per
    position of its ``length`` tokens."""
    _, required, optional, _ = LOSSES[name]
    allowed = {"target_tokens", *required, *optional}
    missing = [k for k in ("target_tokens", *required) if k not in inputs]
    if missing:
        raise LossInputError(f"datum {index}: loss {name} needs loss_fn_inputs "
                             f"{', '.join(missing)}")  # fmt: skip
    extra = sorted(set(inputs) - allowed)
    if extra:
        raise LossInputError(f"datum {index}: loss {name} does not read {', '.join(extra)}; "
                             f"it reads {', '.join(sorted(allowed))}")  # fmt: skip
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
    """The per-token loss of one datum under loss ``name`` (checked by the callers)."""
    floats = {k: v.to(logp.dtype) for k, v in inputs.items() if k != "target_tokens"}
    return LOSSES[name][0](logp, floats, config or {})
