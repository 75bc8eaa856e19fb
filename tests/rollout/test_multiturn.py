"""Multi-turn episodes against real vLLM replicas behind the real proxy: the token ids of an
episode are exactly the ones vLLM generated (never re-tokenised), environment tokens are marked,
and every policy token's served logprob equals transformers + peft on the whole sequence."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from asyncgrpo.config.rollout import GenerationConfig, RolloutConfig
from asyncgrpo.proxy import ProxyConfig, serve_proxy
from asyncgrpo.rollout.client import RolloutClient
from asyncgrpo.rollout.dataset import Prompt, PromptDataset, load_tokenizer
from asyncgrpo.rollout.environment import Episode
from asyncgrpo.rollout.policy import PolicyClient, Turn
from asyncgrpo.testing.envs import ChatterEnv
from asyncgrpo.testing.tiny import ReferencePolicy
from asyncgrpo.vllm.client import VLLMClient

pytestmark = [pytest.mark.anyio, pytest.mark.vllm]


class _Recording:
    """The policy client, keeping every turn exactly as vLLM returned it."""

    def __init__(self, inner: PolicyClient, into: list[Turn]) -> None:
        self.inner, self.into = inner, into

    async def complete(self, prompt_ids: Any, **kw: Any) -> list[Turn]:
        turns = await self.inner.complete(prompt_ids, **kw)
        self.into += turns
        return turns


class RecordingChatter(ChatterEnv):
    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.turns: list[Turn] = []

    async def group(self, task: Prompt, policy: PolicyClient, g: int) -> list[Episode]:
        return await super().group(task, _Recording(policy, self.turns), g)  # type: ignore[arg-type]


def runs(mask: list[bool]) -> list[tuple[bool, int, int]]:
    """(is_policy, start, end) of each run of equal mask values."""
    out: list[tuple[bool, int, int]] = []
    for i, m in enumerate(mask):
        if out and out[-1][0] == m:
            out[-1] = (m, out[-1][1], i + 1)
        else:
            out.append((m, i, i + 1))
    return out


@pytest.mark.parametrize("mode", ["n", "per_sample"])
async def test_multi_turn_episodes_are_token_exact(
    vllm_replicas: list[Any], tiny_model: Path, lora_adapter: Path, mode: str
) -> None:
    tok = load_tokenizer(tiny_model)
    name = f"multiturn-{mode.replace('_', '-')}-v1"
    rows = [[{"role": "user", "content": f"tell me about number {i}"}] for i in range(3)]
    gen = GenerationConfig(num_generations=4, max_completion_length=8, request_mode=mode)  # type: ignore[arg-type]
    env = RecordingChatter(tokenizer=tok, generation=gen, max_turns=3, max_episode_tokens=512)
    proxy = ProxyConfig(
        upstreams=tuple(r.url for r in vllm_replicas),
        port=0,
        lora_roots=(str(lora_adapter.parent),),
    )
    async with serve_proxy(proxy) as url, VLLMClient(url) as admin:
        await admin.load_lora_adapter(name, str(lora_adapter))
        try:
            client = RolloutClient(
                base_url=url,
                dataset=PromptDataset(rows, tokenizer=tok, shuffle=False),
                generation=gen,
                rollout=RolloutConfig(max_inflight=8),
                policy=(name, 1),
                environment=env,
            )
            async with client:
                samples = await client.get(100)
                stats = client.stats()
        finally:
            await admin.unload_lora_adapter(name)

    assert len(samples) == 12 and stats["rollout/model_turns_total"] == 36
    served: dict[tuple[int, ...], list[list[int]]] = {}
    for t in env.turns:
        served.setdefault(tuple(t.prompt_ids), []).append(t.token_ids)
    reference = ReferencePolicy(tiny_model, lora_adapter)
    retokenised_differs = 0
    for s in samples:
        assert s.completion_mask is not None and s.versions == [1] * len(s.completion_ids)
        spans = runs(s.completion_mask)
        assert [p for p, _, _ in spans] == [True, False, True, False, True], spans
        ids = s.prompt_ids + s.completion_ids
        for is_policy, start, end in spans:
            if is_policy:  # each model turn is exactly what vLLM sampled for exactly this prefix
                prefix = tuple(ids[: len(s.prompt_ids) + start])
                assert s.completion_ids[start:end] in served[prefix]
            else:
                assert tok.decode(s.completion_ids[start:end]).endswith("<|im_start|>assistant\n")
        ours = reference.logprobs(s.prompt_ids, s.completion_ids, temperature=s.temperature)
        for i, is_policy in enumerate(s.completion_mask):
            if is_policy:
                assert abs(ours[i] - s.logprobs[i]) < 1e-4, (i, ours[i], s.logprobs[i])
            else:
                assert s.logprobs[i] == 0.0
        text = tok.decode(s.completion_ids, skip_special_tokens=False)
        retokenised_differs += tok.encode(text, add_special_tokens=False) != s.completion_ids
    # What the assertions above guard against: re-tokenising the episode's text gives other ids.
    assert retokenised_differs > 0
