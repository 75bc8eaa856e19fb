"""The end-to-end proof that vLLM served the policy the trainer thinks it did.

For each sample, recompute its completion's logprobs with transformers + peft under the adapter
version the sample is tagged with (fetched from the store), and compare with the logprobs vLLM
returned. Float32 on both sides agrees to ~1e-6; a replica serving a stale or wrong version
differs by orders of magnitude more.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import anyio

from asyncgrpo.adapters import AdapterStore
from asyncgrpo.sample import Sample
from asyncgrpo.testing.tiny import ReferencePolicy


def served_logprob_errors(
    model: str | Path,
    store_url: str,
    adapter_prefix: str,
    samples: Iterable[Sample],
    cache_dir: str | Path,
) -> list[float]:
    """Per sample, max |vLLM logprob - recomputed logprob at the sample's version|.

    Synchronous (loads models): call it from a worker thread in async code.
    """
    store = AdapterStore(store_url)
    by_version: dict[int, list[Sample]] = {}
    for sample in samples:
        by_version.setdefault(sample.version, []).append(sample)
    errors = []
    for version, group in sorted(by_version.items()):
        path = anyio.run(store.fetch, adapter_prefix, version, cache_dir)
        policy = ReferencePolicy(model, path)
        for s in group:
            ours = policy.logprobs(s.prompt_ids, s.completion_ids, temperature=s.temperature)
            errors.append(max(abs(a - b) for a, b in zip(ours, s.logprobs, strict=True)))
    return errors
