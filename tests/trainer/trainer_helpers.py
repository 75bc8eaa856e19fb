"""Synthetic samples for trainer tests (a module, not conftest, so imports are unambiguous)."""

from __future__ import annotations

import math
import random

from asyncgrpo.sample import Sample

VOCAB = 400


def make_samples(
    n: int,
    *,
    seed: int = 0,
    prompt_len: tuple[int, int] = (3, 12),
    completion_len: tuple[int, int] = (1, 10),
    temperature: float = 1.0,
    version: int = 0,
) -> list[Sample]:
    """Random samples with random token ids, behaviour logprobs and advantages."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p = rng.randint(*prompt_len)
        c = rng.randint(*completion_len)
        out.append(
            Sample(
                prompt_ids=[rng.randrange(VOCAB) for _ in range(p)],
                completion_ids=[rng.randrange(VOCAB) for _ in range(c)],
                logprobs=[-rng.uniform(3.0, 9.0) for _ in range(c)],
                reward=rng.random(),
                advantage=rng.uniform(-1.5, 1.5),
                version=version,
                group_id=f"g{i // 4}",
                temperature=temperature,
            )
        )
    return out


def reference_loss(logp, prox, old, adv, seq, correction, cap, *, eps_lo, eps_hi):
    """Plain-Python loss and d(loss)/d(logp) per token, written from the formulas in
    docs/trainer.md (no tensor code shared with the implementation)."""
    clip = lambda x: min(max(x, 1 - eps_lo), 1 + eps_hi)  # noqa: E731
    log_seq: dict[int, float] = {}
    for p, o, s in zip(prox, old, seq, strict=True):
        log_seq[s] = log_seq.get(s, 0.0) + (p - o)
    losses, grads = [], []
    for lp, p, o, a, s in zip(logp, prox, old, adv, seq, strict=True):
        if correction == "none":
            r = math.exp(lp - o)
            f = 1.0
        else:
            r = math.exp(lp - p)
            w = math.exp(p - o)
            if correction in ("decoupled", "tis"):
                f = min(w, cap)
            elif correction == "mis_token":
                f = w if 1 / cap <= w <= cap else 0.0
            else:
                big_w = math.exp(log_seq[s])
                f = big_w if 1 / cap <= big_w <= cap else 0.0
        unclipped, clipped = r * a, clip(r) * a
        # d/dlogp of -min(rA, clip(r)A): -rA where the unclipped term is the min (or r inside
        # the range), else 0 (the clipped term is constant in logp there).
        inside = 1 - eps_lo < r < 1 + eps_hi
        active = inside or unclipped <= clipped
        loss, grad = -min(unclipped, clipped), (-r * a if active else 0.0)
        if correction == "none" and cap is not None and a < 0 and loss > -cap * a:
            loss, grad = -cap * a, 0.0
        losses.append(f * loss)
        grads.append(f * grad)
    return losses, grads
