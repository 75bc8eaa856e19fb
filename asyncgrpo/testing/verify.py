"""The end-to-end proof that vLLM served the policy the trainer thinks it did.

For each sample, recompute its completion's logprobs with transformers + peft under the adapter
version each policy token is tagged with (fetched from the store), and compare with the logprobs
vLLM returned. A multi-turn episode whose turns ran under several versions is recomputed once per
version, each time over the whole sequence, and only that version's tokens are compared;
environment tokens are not the policy's and are skipped. Float32 on both sides agrees to ~1e-6; a
replica serving a stale or wrong version differs by orders of magnitude more.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import anyio

from asyncgrpo.sample import Sample
from asyncgrpo.store.adapters import AdapterStore
from asyncgrpo.testing.tiny import ReferencePolicy


def served_logprob_errors(
    model: str | Path,
    store_url: str,
    adapter_prefix: str,
    samples: Iterable[Sample],
    cache_dir: str | Path,
) -> list[float]:
    """Per (sample, version) pair, max |vLLM logprob - recomputed logprob| over the sample's
    policy tokens generated at that version.

    Synchronous (loads models): call it from a worker thread in async code.
    """
    store = AdapterStore(store_url)
    by_version: dict[int, list[tuple[Sample, list[int]]]] = {}
    for sample in samples:
        positions: dict[int, list[int]] = {}
        mask = sample.policy_mask()
        for i, v in enumerate(sample.token_versions()):
            if mask[i]:
                positions.setdefault(v, []).append(i)
        for v, idx in positions.items():
            by_version.setdefault(v, []).append((sample, idx))
    errors = []
    for version, group in sorted(by_version.items()):
        path = anyio.run(store.fetch, adapter_prefix, version, cache_dir)
        policy = ReferencePolicy(model, path)
        for s, idx in group:
            ours = policy.logprobs(s.prompt_ids, s.completion_ids, temperature=s.temperature)
            errors.append(max(abs(ours[i] - s.logprobs[i]) for i in idx))
    return errors


def next_token_mass(
    model: str | Path,
    adapter_dir: str | Path | None,
    prompts: Iterable[list[int]],
    classes: Sequence[Iterable[int]],
) -> list[float]:
    """For each token class, the mean probability over ``prompts`` that the policy's first
    completion token is in it: an exact (sampling-free) measure of how much a policy favours a
    class. One model load and one forward pass per prompt serve every class."""
    import torch

    policy = ReferencePolicy(model, adapter_dir)
    ids = [torch.tensor(sorted(set(c))) for c in classes]
    totals = [0.0] * len(ids)
    n = 0
    with torch.no_grad():
        for prompt in prompts:
            logits = policy.model(input_ids=torch.tensor([prompt])).logits[0, -1]
            probs = torch.softmax(logits.float(), -1)
            for i, cls in enumerate(ids):
                totals[i] += float(probs[cls].sum())
            n += 1
    return [t / n for t in totals]
