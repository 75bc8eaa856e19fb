"""Synthetic samples for trainer tests (a module, not conftest, so imports are unambiguous)."""

from __future__ import annotations

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
