"""A rollout sample for tests and benchmarks of the sample's codec and the rollout channel."""

from __future__ import annotations

from typing import Any

from asyncgrpo.sample import Sample


def sample(group_id: str, n: int = 5, **fields: Any) -> Sample:
    """A sample of group ``group_id`` with ``n`` completion tokens whose logprobs are exactly
    representable in float32 (as vLLM returns them), so an encode/decode round trip is exact;
    ``fields`` set any other field (reward, advantage and version have defaults)."""
    return Sample(
        prompt_ids=[1, 2, 151_000, 7],
        completion_ids=list(range(100, 100 + n)),
        logprobs=[-0.5 * i - 0.125 for i in range(n)],
        reward=fields.pop("reward", 1.0),
        advantage=fields.pop("advantage", 0.75),
        version=fields.pop("version", 3),
        group_id=group_id,
        **fields,
    )
