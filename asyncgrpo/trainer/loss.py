"""The GRPO loss with an off-policy correction, as pure functions over 1-D tensors of tokens.

Three policies meet at every completion token:

- the **behaviour** policy ``logp_b``: the logprob vLLM returned when it sampled the token, under
  the adapter version the sample is tagged with, possibly several versions old;
- the **proximal** policy ``logp_prox``: the trainer's weights at the start of the optimizer
  step. ``Trainer.step`` takes exactly one optimizer step per batch, so these are the current
  forward pass, detached (no extra compute);
- the **current** policy ``logp`` (with grad).

``w = exp(logp_prox - logp_b)`` is the importance weight of the behaviour policy (staleness plus
vLLM-vs-trainer numerics), ``r = exp(logp - logp_prox)`` the PPO ratio. Per token, with
``clip(x) = clamp(x, 1 - epsilon_low, 1 + epsilon_high)`` and ``C = importance_cap``::

    none          loss_t = -min(r_b A, clip(r_b) A), r_b = exp(logp - logp_b);
                  with C: min(loss_t, -C A) where A < 0 (dual clip, TRL's delta)
    decoupled     loss_t = -f(w) min(r A, clip(r) A),  f(w) = min(w, C)   (Hilton et al.; AReaL)
    tis           the same f(w) = min(w, C), with Yao et al.'s cap
    mis_token     f(w) = w 1[1/C <= w <= C]
    mis_sequence  f = W 1[1/C <= W <= C], W = prod of w over the token's completion

``f`` is a constant (no gradient). At the one point the trainer evaluates it ``r = 1``, so the
clip around the proximal policy never binds and every correction's gradient is
``-f(w) A grad(logp)``; they differ only in ``f``. On fresh tokens (``w`` ~ 1) all five give the
same loss and gradient. Masked tokens still count in the normaliser (as in AReaL and TRL).

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

**Other normalisations** (``trainer.loss_type``, TRL's names): ``grpo`` averages each
completion's tokens, then the completions; ``dr_grpo`` divides the sum by completions x the
completion-length bound. Both are per-token factors (``token_normaliser``) computed from the
step's counts, so micro-batches and ranks still add up to the step's loss.

**KL penalty** (``trainer.beta``): ``beta * kl_t`` per token with TRL's k3 estimate against the
reference policy, the base model (the adapter disabled), added after the correction's weight.

**Metrics** come back as sums (and maxima) so micro-batches and ranks combine them
(``add_stats``) before one division (``finalize_stats``). ``ratio`` is the mean ``w`` over the
*on-policy* tokens only (sampled from exactly the trainer's current weights): there it is the
trainer's logprob over vLLM's at the sample's own version, ~1 when vLLM serves the policy the
trainer thinks it does; NaN in a step without such tokens. ``kl`` (k3 estimate of
KL(behaviour || current), as TRL) and ``entropy`` cover all tokens; ``clip_ratio/*`` count
tokens whose PPO ratio left the clip range. Per staleness ``s`` (versions behind the trainer's
newest published version, one bucket per value up to ``max_staleness``):
``off_policy/staleness_{s}/tokens`` (share of the step's tokens: the histogram) and, where it
has tokens, ``weight_mean``, ``weight_max`` (of the uncapped ``w``), ``truncated`` and
``masked`` (shares of its tokens); the same four over all tokens as ``off_policy/*``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from asyncgrpo.config.trainer import TrainerConfig

#: The default ``importance_cap`` of each correction (None: no cap).
DEFAULT_CAPS: dict[str, float | None] = {
    "none": None,  # no dual clip, as TRL's delta=None
    "decoupled": 5.0,  # as AReaL's example configs (behav_imp_weight_cap)
    "tis": 2.0,  # Yao et al.; verl and slime default to 2
    "mis_token": 2.0,  # verl / slime: kept within [1/2, 2]
    "mis_sequence": 2.0,
}


@dataclass(frozen=True)
class Objective:
    """The per-token objective: which correction, its cap, the PPO clip range."""

    correction: str = "decoupled"
    cap: float | None = None  # None: DEFAULT_CAPS[correction]
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    beta: float = 0.0  # KL penalty to the reference policy (0: none)

    def __post_init__(self) -> None:
        if self.correction not in DEFAULT_CAPS:
            raise ValueError(f"unknown off-policy correction {self.correction!r}")
        if not self.beta >= 0:
            raise ValueError(f"beta={self.beta}: the KL coefficient must be >= 0")

    @classmethod
    def from_config(cls, cfg: TrainerConfig) -> Objective:
        return cls(
            correction=cfg.off_policy,
            cap=cfg.importance_cap,
            epsilon_low=cfg.epsilon,
            epsilon_high=cfg.clip_high,
            beta=cfg.beta,
        )

    @property
    def effective_cap(self) -> float | None:
        return self.cap if self.cap is not None else DEFAULT_CAPS[self.correction]


class Terms(NamedTuple):
    """What ``per_token_loss`` computed besides the loss, for metrics (all detached)."""

    ratio: torch.Tensor  #: the PPO ratio the clip saw (r_b for none, r otherwise)
    weight: torch.Tensor  #: w = exp(logp_prox - logp_b), uncapped
    truncated: torch.Tensor  #: bool: the cap lowered this token's weight
    masked: torch.Tensor  #: bool: the cap dropped this token
    kl_ref: torch.Tensor | None = None  #: k3 KL(current || reference) per token, if scored


def _sequence_log_weights(log_w: torch.Tensor, sequence_ids: torch.Tensor) -> torch.Tensor:
    """Per token, ``log W`` of its sequence: the sum of ``log w`` over the sequence's tokens."""
    n = int(sequence_ids.max()) + 1 if sequence_ids.numel() else 0
    sums = log_w.new_zeros(n).index_add_(0, sequence_ids, log_w)
    return sums[sequence_ids]


def per_token_loss(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    objective: Objective,
    *,
    proximal_logp: torch.Tensor | None = None,
    sequence_ids: torch.Tensor | None = None,
    reference_logp: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Terms]:
    """Per-token loss and its terms; all tensors 1-D and aligned.

    ``proximal_logp`` defaults to ``logp.detach()`` (one optimizer step per batch);
    ``sequence_ids`` numbers each token's completion (needed by ``mis_sequence``);
    ``reference_logp`` (the base model's, needed when ``objective.beta > 0``) adds
    ``beta * kl_t``, ``kl_t = exp(ref - logp) - (ref - logp) - 1`` (k3, as TRL), unweighted by
    the off-policy correction, as TRL adds it after its importance weight.
    """
    cap = objective.effective_cap
    prox = logp.detach() if proximal_logp is None else proximal_logp.to(logp.dtype)
    log_w = prox - behaviour_logp
    weight = torch.exp(log_w)
    no = torch.zeros_like(advantages, dtype=torch.bool)
    truncated, masked = no, no
    if objective.correction == "none":
        ratio = torch.exp(logp - behaviour_logp)
        coef = None
    else:
        ratio = torch.exp(logp - prox)
        coef, truncated, masked = _token_weights(objective.correction, log_w, cap, sequence_ids)
    clipped = torch.clamp(ratio, 1.0 - objective.epsilon_low, 1.0 + objective.epsilon_high)
    loss = -torch.min(ratio * advantages, clipped * advantages)
    if coef is not None:
        loss = coef * loss
    elif cap is not None:
        truncated = (advantages < 0) & (ratio.detach() > cap)
        loss = torch.where(advantages < 0, torch.minimum(loss, -cap * advantages), loss)
    kl_ref = None
    if objective.beta > 0:
        if reference_logp is None:
            raise ValueError("beta > 0 needs reference_logp (the base model's logprobs)")
        delta = reference_logp.to(logp.dtype) - logp
        kl_t = torch.exp(delta) - delta - 1.0
        loss = loss + objective.beta * kl_t
        kl_ref = kl_t.detach()
    return loss, Terms(ratio.detach(), weight, truncated, masked, kl_ref)


LOSS_TYPES = ("dapo", "grpo", "dr_grpo")


def token_normaliser(
    loss_type: str,
    sequence_tokens: torch.Tensor,
    *,
    num_tokens: int | float,
    num_sequences: int | float,
    max_length: int | float,
) -> torch.Tensor:
    """Per token, the factor its loss enters the step's loss with (TRL's ``loss_type``).

    ``sequence_tokens``: per token, the loss tokens of its completion; ``num_tokens`` and
    ``num_sequences``: the step's (all micro-batches and ranks); ``max_length``: the
    completion-length bound. 'dapo' ``1 / num_tokens`` (token-level mean); 'grpo'
    ``1 / (sequence_tokens * num_sequences)`` (mean per completion, then over completions);
    'dr_grpo' ``1 / (num_sequences * max_length)`` (a constant: no length bias).
    """
    ones = torch.ones_like(sequence_tokens, dtype=torch.float32)
    if loss_type == "dapo":
        return ones / num_tokens
    if loss_type == "grpo":
        return ones / (sequence_tokens.to(torch.float32).clamp(min=1) * num_sequences)
    if loss_type == "dr_grpo":
        return ones / (num_sequences * max_length)
    raise ValueError(f"unknown loss_type {loss_type!r}: use one of {', '.join(LOSS_TYPES)}")


def _token_weights(
    correction: str, log_w: torch.Tensor, cap: float | None, sequence_ids: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``f(w)`` per token, and which tokens the cap truncated or masked."""
    no = torch.zeros_like(log_w, dtype=torch.bool)
    log_cap = math.log(cap) if cap is not None else math.inf
    if correction == "mis_sequence":
        if sequence_ids is None:
            raise ValueError("mis_sequence needs sequence_ids (which completion each token is in)")
        log_w = _sequence_log_weights(log_w, sequence_ids)
    if correction in ("decoupled", "tis"):
        truncated = log_w > log_cap
        return torch.exp(torch.clamp(log_w, max=log_cap)), truncated, no
    keep = (log_w <= log_cap) & (log_w >= -log_cap)  # mis_token, mis_sequence: two-sided
    # exp of the clamped value: a dropped token's weight never overflows into inf * 0
    coef = torch.where(keep, torch.exp(torch.clamp(log_w, max=log_cap)), torch.zeros_like(log_w))
    return coef, no, ~keep


# ---------------------------------------------------------------------------------------------
# Metric sums
# ---------------------------------------------------------------------------------------------


def stat_keys(buckets: int) -> list[str]:
    """Every key ``grpo_loss`` returns, in a fixed order (ranks exchange them as one vector).

    Keys ending in ``_max`` combine by maximum, the others by sum.
    """
    keys = ["count", "kl", "entropy", "clip/low", "clip/high", "clip/region", "on_policy",
            "on_policy/weight", "kl_ref", "kl_ref/count"]  # fmt: skip
    for s in range(buckets):
        keys += [
            f"s{s}/tokens",
            f"s{s}/weight",
            f"s{s}/truncated",
            f"s{s}/masked",
            f"s{s}/weight_max",
        ]
    return keys


def grpo_loss(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    objective: Objective,
    *,
    num_tokens: int | float,
    staleness: torch.Tensor | None = None,
    on_policy: torch.Tensor | None = None,
    buckets: int = 1,
    proximal_logp: torch.Tensor | None = None,
    sequence_ids: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    reference_logp: torch.Tensor | None = None,
    normaliser: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Loss of one micro-batch, ``sum(loss_t) / num_tokens``, and its metric sums.

    ``normaliser`` (per token, from ``token_normaliser``) replaces ``1 / num_tokens`` for the
    other loss types; ``reference_logp`` is the base model's (``objective.beta > 0``).

    ``logp`` (with grad) and the other per-token tensors hold the micro-batch's completion
    tokens only; ``num_tokens`` is the completion-token count of the whole optimizer step (see
    the module docstring). ``staleness`` (versions, per token; default 0) is bucketed into
    ``0 .. buckets - 1``, the last bucket taking anything older; ``on_policy`` (bool, per
    token; default all) marks the tokens sampled from the trainer's current weights.
    """
    if num_tokens <= 0:
        raise ValueError(f"num_tokens={num_tokens}: an optimizer step needs completion tokens")
    behaviour_logp = behaviour_logp.to(logp.dtype)
    advantages = advantages.to(logp.dtype)
    loss_t, terms = per_token_loss(
        logp,
        behaviour_logp,
        advantages,
        objective,
        proximal_logp=proximal_logp,
        sequence_ids=sequence_ids,
        reference_logp=reference_logp,
    )
    if normaliser is None:
        loss = loss_t.sum() / num_tokens
    else:
        loss = (loss_t * normaliser.to(loss_t.dtype)).sum()
    with torch.no_grad():
        sums = _sums(
            logp.detach(),
            behaviour_logp,
            advantages,
            objective,
            terms,
            entropy,
            staleness,
            on_policy,
            buckets,
        )
    return loss, sums


def _sums(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    objective: Objective,
    terms: Terms,
    entropy: torch.Tensor | None,
    staleness: torch.Tensor | None,
    on_policy: torch.Tensor | None,
    buckets: int,
) -> dict[str, float]:
    n = logp.numel()
    dt = torch.float64
    ratio, weight = terms.ratio.to(dt), terms.weight.to(dt)
    log_r = logp.to(dt) - behaviour_logp.to(dt)
    low = (ratio < 1.0 - objective.epsilon_low) & (advantages < 0)
    high = (ratio > 1.0 + objective.epsilon_high) & (advantages > 0)
    on = torch.ones(n, dtype=torch.bool, device=logp.device) if on_policy is None else on_policy
    on = on.to(logp.device)
    out = {
        "count": float(n),
        "kl": float(((torch.exp(log_r) - 1.0) - log_r).sum()),
        "entropy": float(entropy.detach().to(dt).sum()) if entropy is not None else 0.0,
        "clip/low": float(low.sum()),
        "clip/high": float(high.sum()),
        "clip/region": float((low | high).sum()),
        "on_policy": float(on.sum()),
        "on_policy/weight": float(weight[on].sum()),
        "kl_ref": float(terms.kl_ref.to(dt).sum()) if terms.kl_ref is not None else 0.0,
        "kl_ref/count": float(n) if terms.kl_ref is not None else 0.0,
    }
    lag = torch.zeros(n, dtype=torch.long) if staleness is None else staleness.to(torch.long)
    bucket = lag.to(logp.device).clamp(0, buckets - 1)
    per = torch.stack(
        [torch.ones_like(weight), weight, terms.truncated.to(dt), terms.masked.to(dt)]
    )
    totals = per.new_zeros(4, buckets).index_add_(1, bucket, per).tolist()
    maxes = weight.new_full((buckets,), -math.inf).scatter_reduce(0, bucket, weight, "amax")
    for s in range(buckets):
        out[f"s{s}/tokens"] = totals[0][s]
        out[f"s{s}/weight"] = totals[1][s]
        out[f"s{s}/truncated"] = totals[2][s]
        out[f"s{s}/masked"] = totals[3][s]
        out[f"s{s}/weight_max"] = float(maxes[s])
    return out


def add_stats(total: dict[str, float], part: dict[str, float]) -> dict[str, float]:
    """Accumulate metric sums of one micro-batch into ``total`` (in place) and return it."""
    for key, value in part.items():
        if key not in total:
            total[key] = value
        elif key.endswith("_max"):
            total[key] = max(total[key], value)
        else:
            total[key] += value
    return total


def finalize_stats(sums: dict[str, float], buckets: int = 1) -> dict[str, float]:
    """Turn accumulated sums into the step's metrics (see the module docstring)."""
    count = sums.get("count", 0.0)
    nan = math.nan

    def div(a: float, b: float) -> float:
        return a / b if b > 0 else nan

    on = sums.get("on_policy", 0.0)
    out = {
        "ratio": div(sums.get("on_policy/weight", 0.0), on),
        "ratio/tokens": div(on, count),
        "kl": div(sums.get("kl", 0.0), count),
        "entropy": div(sums.get("entropy", 0.0), count),
        "clip_ratio/low_mean": div(sums.get("clip/low", 0.0), count),
        "clip_ratio/high_mean": div(sums.get("clip/high", 0.0), count),
        "clip_ratio/region_mean": div(sums.get("clip/region", 0.0), count),
    }
    if sums.get("kl_ref/count", 0.0) > 0:  # only with a KL penalty (beta > 0)
        out["kl_ref"] = sums["kl_ref"] / sums["kl_ref/count"]
    total = {"weight": 0.0, "truncated": 0.0, "masked": 0.0}
    weight_max = -math.inf
    for s in range(buckets):
        tokens = sums.get(f"s{s}/tokens", 0.0)
        out[f"off_policy/staleness_{s}/tokens"] = div(tokens, count)
        if tokens <= 0:
            continue
        prefix = f"off_policy/staleness_{s}/"
        out[prefix + "weight_mean"] = sums[f"s{s}/weight"] / tokens
        out[prefix + "weight_max"] = sums[f"s{s}/weight_max"]
        out[prefix + "truncated"] = sums[f"s{s}/truncated"] / tokens
        out[prefix + "masked"] = sums[f"s{s}/masked"] / tokens
        for k in total:
            total[k] += sums[f"s{s}/{k}"]
        weight_max = max(weight_max, sums[f"s{s}/weight_max"])
    out["off_policy/weight_mean"] = div(total["weight"], count)
    out["off_policy/weight_max"] = weight_max if count > 0 else nan
    out["off_policy/truncated"] = div(total["truncated"], count)
    out["off_policy/masked"] = div(total["masked"], count)
    return out
