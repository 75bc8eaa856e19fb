"""The GRPO loss, as pure functions over 1-D tensors of completion tokens.

Per token, with ``r = exp(logp - logp_behaviour)`` (``logp_behaviour`` is what vLLM returned when
it sampled the token)::

    loss_t = -min(r * A, clip(r, 1 - epsilon_low, 1 + epsilon_high) * A)

**Normalisation (token-level mean over the whole optimizer step).** An optimizer step covers
several micro-batches (packed rows). Each micro-batch contributes
``sum(loss_t over its completion tokens) / N``, where ``N`` is the number of completion tokens
in the *whole step* (all micro-batches), and the trainer calls ``backward`` on each. Gradients
add up across micro-batches, so after the last one the accumulated gradient is exactly the
gradient of the token-level mean over the step, however the samples were split into rows;
there is no extra division by the number of micro-batches. A long completion therefore weighs
in proportion to its length (no per-sequence averaging). Tokens of zero-advantage groups count
in ``N`` but add nothing to the sum. With data parallelism, ``N`` is the completion tokens of
all ranks (exchanged before the first micro-batch) and the ranks' gradients are summed, which
gives exactly the single-process gradient (``trainer.distributed``).

**Truncated importance sampling (``tis_cap``).** The ratio is taken against a behaviour policy
that may be several versions old. For ``A > 0`` the clip already bounds the objective, but for
``A < 0`` the objective ``-A * max(r, clip(r))`` grows without bound in ``r``: one token the
current policy now finds far likelier than the stale policy did can dominate the step. With
``tis_cap = C`` (> ``1 + epsilon_high``) the ratio is truncated at ``C`` there (dual-clip PPO):
``loss_t = min(loss_t, -C * A)`` for ``A < 0``, which zeroes the gradient of such tokens.

Metrics are returned as sums (``stat_sums``) so micro-batches, and later ranks, add them up
before one division (``finalize_stats``): ``ratio`` (mean r; ~1 proves vLLM serves the policy
the trainer thinks it does), ``kl`` (k3 estimate of KL(behaviour || policy), ``(r - 1) - log r``,
as TRL), ``entropy``, ``clip_ratio/low_mean`` (r below ``1 - epsilon_low`` with ``A < 0``),
``clip_ratio/high_mean`` (r above ``1 + epsilon_high`` with ``A > 0``),
``clip_ratio/region_mean`` (either) and, with a cap, ``clip_ratio/tis_mean``.
"""

from __future__ import annotations

import torch

#: Keys of the sums ``grpo_loss`` returns; ``count`` is the number of completion tokens.
STAT_KEYS = (
    "ratio",
    "kl",
    "entropy",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
    "clip_ratio/tis_mean",
    "count",
)


def per_token_loss(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    *,
    epsilon_low: float,
    epsilon_high: float,
    tis_cap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped surrogate loss and the ratio ``r``; all tensors are 1-D and aligned."""
    ratio = torch.exp(logp - behaviour_logp)
    clipped = torch.clamp(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)
    loss = -torch.min(ratio * advantages, clipped * advantages)
    if tis_cap is not None:
        capped = torch.minimum(loss, -tis_cap * advantages)
        loss = torch.where(advantages < 0, capped, loss)
    return loss, ratio


def grpo_loss(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    *,
    num_tokens: int | float,
    epsilon_low: float,
    epsilon_high: float,
    tis_cap: float | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Loss of one micro-batch, ``sum(loss_t) / num_tokens``, and its metric sums.

    ``logp`` (with grad), ``behaviour_logp``, ``advantages`` and ``entropy`` hold the
    micro-batch's completion tokens only; ``num_tokens`` is the completion-token count of the
    whole optimizer step (see the module docstring).
    """
    if num_tokens <= 0:
        raise ValueError(f"num_tokens={num_tokens}: an optimizer step needs completion tokens")
    behaviour_logp = behaviour_logp.to(logp.dtype)
    advantages = advantages.to(logp.dtype)
    loss_t, ratio = per_token_loss(
        logp,
        behaviour_logp,
        advantages,
        epsilon_low=epsilon_low,
        epsilon_high=epsilon_high,
        tis_cap=tis_cap,
    )
    loss = loss_t.sum() / num_tokens
    with torch.no_grad():
        ratio = ratio.detach()
        log_ratio = logp.detach() - behaviour_logp
        low = (ratio < 1.0 - epsilon_low) & (advantages < 0)
        high = (ratio > 1.0 + epsilon_high) & (advantages > 0)
        tis = (ratio > tis_cap) & (advantages < 0) if tis_cap is not None else torch.zeros_like(low)
        sums = torch.stack(
            [
                ratio.sum(),
                ((ratio - 1.0) - log_ratio).sum(),
                entropy.detach().to(ratio.dtype).sum()
                if entropy is not None
                else ratio.new_zeros(()),
                low.sum().to(ratio.dtype),
                high.sum().to(ratio.dtype),
                (low | high).sum().to(ratio.dtype),
                tis.sum().to(ratio.dtype),
                ratio.new_tensor(float(ratio.numel())),
            ]
        ).tolist()
    return loss, dict(zip(STAT_KEYS, sums, strict=True))


def add_stats(total: dict[str, float], part: dict[str, float]) -> dict[str, float]:
    """Accumulate metric sums of one micro-batch into ``total`` (in place) and return it."""
    for key, value in part.items():
        total[key] = total.get(key, 0.0) + value
    return total


def finalize_stats(sums: dict[str, float], *, with_tis: bool = False) -> dict[str, float]:
    """Turn accumulated sums into per-token means (NaN when there were no tokens)."""
    count = sums.get("count", 0.0)
    keys = [k for k in STAT_KEYS if k != "count" and (with_tis or k != "clip_ratio/tis_mean")]
    if count <= 0:
        return {k: float("nan") for k in keys}
    return {k: sums.get(k, 0.0) / count for k in keys}
