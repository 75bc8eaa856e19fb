"""The rollout client against a real vLLM replica (shared session fixture), through a small
aiohttp pass-through where a test must count concurrency or inject failures, and through the
real proxy where it meets several replicas."""

from __future__ import annotations

import contextlib
import json
import math
import re
import socket
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import pytest
from aiohttp import web

from asyncgrpo.config.rollout import GenerationConfig, RolloutConfig
from asyncgrpo.errors import ConfigError, ReplicaError
from asyncgrpo.proxy import ProxyConfig, serve_proxy
from asyncgrpo.retry import poll_until
from asyncgrpo.rollout.client import RolloutClient
from asyncgrpo.rollout.dataset import PromptDataset, load_tokenizer
from asyncgrpo.rollout.rewards import RewardScorer

pytestmark = [pytest.mark.anyio, pytest.mark.vllm]

WORDS = "cat dog bird fish red blue green sun moon star tree road".split()


def length_reward(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
    return [float(len(ids)) for ids in kwargs["completion_ids"]]


def make_dataset(tiny_model: Path, n: int, **kwargs: Any) -> PromptDataset:
    rows = [
        [{"role": "user", "content": f"{WORDS[i % 12]} {WORDS[(i * 5) % 12]} number {i}"}]
        for i in range(n)
    ]
    return PromptDataset(rows, tokenizer=load_tokenizer(tiny_model), shuffle=False, **kwargs)


@pytest.fixture(scope="module")
def served(vllm_replicas: list[Any]) -> tuple[str, str]:
    """(url of replica 0, the name it serves the base model under)."""
    url = vllm_replicas[0].url
    with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as resp:
        models = json.load(resp)["data"]
    return url, next(m["id"] for m in models if m.get("parent") is None)


def client_for(
    served: tuple[str, str],
    dataset: PromptDataset,
    *,
    url: Any = None,
    generation: dict[str, Any] | None = None,
    rollout: dict[str, Any] | None = None,
    scorer: RewardScorer | None = None,
    version: int = 0,
    adapter_wait_s: float = 0.0,
) -> RolloutClient:
    return RolloutClient(
        base_url=url or served[0],
        dataset=dataset,
        generation=GenerationConfig(
            **{"num_generations": 4, "max_completion_length": 8, **(generation or {})}
        ),
        rollout=RolloutConfig(**{"max_inflight": 16, "retry_backoff_s": 0.05, **(rollout or {})}),
        scorer=scorer or RewardScorer([length_reward]),
        policy=(served[1], version),
        adapter_wait_s=adapter_wait_s,
    )


class PassThrough:
    """Forwards /v1/completions to a real replica; counts completions in flight; can fail."""

    def __init__(
        self,
        upstream: str,
        *,
        fail_first: int = 0,
        mode: str = "503",
        on_request: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.upstream = upstream
        self.on_request = on_request
        self.fail_left = fail_first
        self.mode = mode
        self.current = 0
        self.max_current = 0
        self.requests = 0
        self.failed = 0

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests += 1
        if self.on_request is not None:
            self.on_request(body)
        if self.fail_left > 0:
            self.fail_left -= 1
            self.failed += 1
            if self.mode == "drop":
                assert request.transport is not None
                request.transport.close()
            return web.Response(status=503, text="injected failure")
        n = int(body.get("n", 1))
        self.current += n
        self.max_current = max(self.max_current, self.current)
        try:
            async with self.session.post(f"{self.upstream}/v1/completions", json=body) as resp:
                data = await resp.read()
                return web.Response(body=data, status=resp.status, content_type="application/json")
        finally:
            self.current -= n

    @contextlib.asynccontextmanager
    async def serve(self, port: int = 0) -> AsyncIterator[str]:
        self.session = aiohttp.ClientSession()
        app = web.Application()
        app.router.add_post("/v1/completions", self.handle)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", port)
        await site.start()
        port = runner.addresses[0][1]
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            await runner.cleanup()
            await self.session.close()


async def test_groups_logprobs_and_version_tagging(served, tiny_model) -> None:
    dataset = make_dataset(tiny_model, 6)
    # One group admitted at a time, 4 samples queued, one scorer: when 8 samples have been
    # taken, at most groups 2 (queue), 3 (scorer) and 4 (generating) exist, so group 5 is
    # requested after the switch.
    rollout = {"queue_maxsize": 4, "max_inflight": 4, "score_concurrency": 1}
    started = anyio.current_time()
    async with client_for(served, dataset, rollout=rollout, version=1) as client:
        first = await client.get(8)
        client.set_policy(served[1], 2)
        rest = await client.get(100)
        stats = client.stats()
        elapsed = anyio.current_time() - started
        assert client.position == 6
    samples = first + rest
    assert len(first) == 8 and len(rest) == 16
    groups = Counter(s.group_id for s in samples)
    assert groups == {str(i): 4 for i in range(6)}
    for s in samples:
        assert 1 <= len(s.completion_ids) <= 8
        assert len(s.logprobs) == len(s.completion_ids)
        assert all(lp <= 0.0 and math.isfinite(lp) for lp in s.logprobs)
        assert s.prompt_ids == dataset.at(int(s.group_id)).prompt_ids
        assert s.reward == len(s.completion_ids) and s.rewards == {"length_reward": s.reward}
    assert {s.version for s in first} == {1}
    assert {s.version for s in samples if s.group_id == "5"} == {2}
    for gid in groups:
        group = [s for s in samples if s.group_id == gid]
        assert len({s.version for s in group}) == 1, "n=G: one request, one version"
        rewards = [s.reward for s in group]
        if len(set(rewards)) > 1:
            mean = sum(rewards) / 4
            assert all((s.advantage > 0) == (s.reward > mean) for s in group)
        else:
            assert all(s.advantage == 0.0 for s in group)
    assert stats["rollout/generated_tokens_total"] == sum(len(s.completion_ids) for s in samples)
    assert stats["rollout/samples_total"] == 24 and stats["rollout/groups_total"] == 6
    assert stats["rollout/generated_tok_s"] > 0
    assert 0 < stats["rollout/busy_s"] <= elapsed  # time with a request in flight


async def test_seed_gives_the_same_completions_in_both_request_modes(served, tiny_model) -> None:
    results = {}
    for mode in ("n", "per_sample"):
        gen = {"seed": 1234, "request_mode": mode}
        async with client_for(served, make_dataset(tiny_model, 2), generation=gen) as client:
            samples = await client.get(8)
        results[mode] = sorted((s.group_id, tuple(s.completion_ids)) for s in samples)
    assert results["n"] == results["per_sample"]
    assert len({ids for _, ids in results["n"]}) > 1, "children must not share one seed"


async def test_max_inflight_counts_completions(served, tiny_model) -> None:
    for mode, max_inflight in (("n", 8), ("per_sample", 6)):
        proxy = PassThrough(served[0])
        async with proxy.serve() as url:
            client = client_for(
                served,
                make_dataset(tiny_model, 10),
                url=url,
                generation={"request_mode": mode, "num_generations": 3},
                rollout={"max_inflight": max_inflight},
            )
            seen_inflight = 0
            async with client:
                samples = []
                while len(samples) < 30:
                    samples += await client.get(3)
                    seen_inflight = max(seen_inflight, client.stats()["rollout/inflight"])
        assert len(samples) == 30
        assert proxy.max_current <= max_inflight, (mode, proxy.max_current)
        assert proxy.max_current > 3, f"{mode}: never more than one group in flight"
        assert seen_inflight <= max_inflight
        expected_requests = 10 if mode == "n" else 30
        assert proxy.requests == expected_requests


async def test_several_replicas_go_behind_the_proxy(vllm_replicas, served, tiny_model) -> None:
    """The client keeps no balancer: given several URLs it says to use the proxy, and through
    the proxy it reaches every replica under its one global cap."""
    urls = [r.url for r in vllm_replicas]
    with pytest.raises(ConfigError, match=r"base_url=\[.*put the proxy in front of them"):
        client_for(served, make_dataset(tiny_model, 1), url=urls)
    async with serve_proxy(ProxyConfig(upstreams=tuple(urls), port=0)) as base:
        client = client_for(
            served,
            make_dataset(tiny_model, 12),
            url=base,
            generation={"request_mode": "per_sample", "num_generations": 4},
            rollout={"max_inflight": 8},
        )
        async with client:
            samples = []
            while batch := await client.get(4):
                samples += batch
                assert client.stats()["rollout/inflight"] <= 8
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{base}/proxy/stats") as resp:
                routed = [u["routed"] for u in (await resp.json())["upstreams"]]
    assert len(samples) == 48
    assert sum(routed) >= 48 and min(routed) > 0, routed
    # Each sample names the replica that served it (the trainer's audit reads it).
    assert {s.replica for s in samples} == set(urls)


async def test_backpressure_when_nobody_consumes(served, tiny_model) -> None:
    client = client_for(
        served,
        make_dataset(tiny_model, 40),
        rollout={"queue_maxsize": 4, "max_inflight": 8, "score_concurrency": 1},
    )
    async with client:
        await anyio.sleep(3.0)
        stats = client.stats()
        assert stats["rollout/queue_size"] == 4
        assert stats["rollout/backpressure_s"] > 1.0, stats
        assert stats["rollout/score_block_s"] > 0.5, stats
        assert stats["rollout/admitted"] <= 8
        later = client.stats()
        assert later["rollout/backpressure_total_s"] >= stats["rollout/backpressure_total_s"]
        await client.get(8)  # consuming unblocks the pipeline
        await anyio.sleep(0.5)
        assert client.stats()["rollout/samples_total"] > 4


async def test_raising_reward_function_does_not_kill_the_run(served, tiny_model) -> None:
    calls = 0

    def flaky(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
        nonlocal calls
        calls += 1
        if calls % 2:
            raise RuntimeError("reward backend down")
        return [1.0] * len(completions)

    scorer = RewardScorer([flaky, length_reward])
    async with client_for(served, make_dataset(tiny_model, 4), scorer=scorer) as client:
        samples = await client.get(100)
        stats = client.stats()
    assert len(samples) == 16
    assert stats["rollout/reward_errors_total"] == 2
    assert stats["rollout/reward_nan_total"] == 8
    assert sum(math.isnan(s.rewards["flaky"]) for s in samples) == 8
    assert all(math.isfinite(s.reward) for s in samples), "length_reward still scores them"

    async def always_raises(prompts: list[Any], completions: list[Any], **kw: Any) -> list[float]:
        raise ValueError("bad")

    scorer = RewardScorer([always_raises])
    async with client_for(served, make_dataset(tiny_model, 2), scorer=scorer) as client:
        samples = await client.get(100)
    assert len(samples) == 8
    assert all(math.isnan(s.reward) and s.advantage == 0.0 for s in samples)


async def test_retries_connection_errors_and_5xx(served, tiny_model) -> None:
    # Connection refused until the server (a restarting proxy) listens again.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    async with client_for(served, make_dataset(tiny_model, 3), url=url) as client:
        with anyio.fail_after(60):
            # refused at least once (a counter to poll: the client has no event for it)
            while client.stats()["rollout/retries_total"] < 1:  # noqa: ASYNC110
                await anyio.sleep(0.01)
        async with PassThrough(served[0]).serve(port):
            samples = await client.get(100)
    assert len(samples) == 12

    for mode in ("503", "drop"):
        proxy = PassThrough(served[0], fail_first=2, mode=mode)
        async with proxy.serve() as url:
            async with client_for(served, make_dataset(tiny_model, 2), url=url) as client:
                samples = await client.get(100)
                assert client.stats()["rollout/retries_total"] == 2
        assert len(samples) == 8 and proxy.failed == 2


async def test_gives_up_after_retries_and_surfaces_4xx(served, tiny_model) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}"
    with pytest.raises(ReplicaError, match=r"giving up after 3 attempts"):
        async with client_for(
            served, make_dataset(tiny_model, 2), url=closed, rollout={"retries": 2}
        ) as client:
            await client.get(100)

    bad = RolloutClient(
        base_url=served[0],
        dataset=make_dataset(tiny_model, 2),
        generation=GenerationConfig(num_generations=2, max_completion_length=4),
        rollout=RolloutConfig(max_inflight=4),
        scorer=RewardScorer([length_reward]),
        policy=("no-such-adapter-v1", 1),
    )
    with pytest.raises(ReplicaError, match=r"HTTP 404 for model 'no-such-adapter-v1'"):
        async with bad:
            await bad.get(100)


async def test_resume_position(served, tiny_model) -> None:
    dataset = make_dataset(tiny_model, 5, epochs=2)
    async with client_for(served, dataset, rollout={"max_inflight": 4}) as client:
        await client.get(12)
        position = client.position
    assert 3 <= position <= 5  # 3 groups taken; the queue and the next group may be done too
    resumed = RolloutClient(
        base_url=served[0],
        dataset=dataset,
        generation=GenerationConfig(num_generations=4, max_completion_length=4),
        rollout=RolloutConfig(max_inflight=16),
        scorer=RewardScorer([length_reward]),
        policy=(served[1], 0),
        start_position=7,
    )
    async with resumed:
        samples = await resumed.get(100)
        assert resumed.position == 10
    assert sorted({s.group_id for s in samples}) == ["7", "8", "9"]


async def test_adapter_swapped_under_a_request_is_resent_under_the_new_name(
    served, tiny_model
) -> None:
    """A 4xx for an adapter that was replaced meanwhile is resent with the current name."""
    client: RolloutClient | None = None
    seen: list[str] = []

    def swap_on_first(body: dict[str, Any]) -> None:
        seen.append(body["model"])
        if len(seen) == 1:  # the sync bumps the policy while this request is on its way
            assert client is not None
            client.set_policy(served[1], 2)

    proxy = PassThrough(served[0], on_request=swap_on_first)
    async with proxy.serve() as url:
        client = client_for(served, make_dataset(tiny_model, 1), url=url)
        client.set_policy("rollout-test-unloaded-v1", 1)
        async with client:
            samples = await client.get(100)
            assert client.stats()["rollout/retries_total"] == 1
    assert seen == ["rollout-test-unloaded-v1", served[1]]
    assert len(samples) == 4 and {s.version for s in samples} == {2}


async def _after_refusals(proxy: PassThrough, n: int) -> None:
    async def seen() -> bool | None:
        return True if proxy.requests >= n else None

    await poll_until(seen, every=0.05, timeout_s=60)


async def test_an_adapter_no_replica_serves_is_waited_for(served, tiny_model, lora_adapter) -> None:
    """A rollout process outlives its trainer's restart: the dead trainer's adapters are
    unloaded, and the resumed one loads its next version. A 404 for the adapter in use is
    sent again until a replica serves it, or under the next policy once it comes; past
    ``adapter_wait_s`` it is an error that says how long it waited."""
    name = "rollout-test-late-v1"
    proxy = PassThrough(served[0])
    async with aiohttp.ClientSession() as session, proxy.serve() as url:
        # served again (a replacement replica catching up, a trainer reloading it)
        client = client_for(served, make_dataset(tiny_model, 1), url=url, adapter_wait_s=60)
        client.set_policy(name, 1)
        async with client, anyio.create_task_group() as tg:

            async def load_late() -> None:
                await _after_refusals(proxy, 2)
                body = {"lora_name": name, "lora_path": str(lora_adapter)}
                async with session.post(f"{served[0]}/v1/load_lora_adapter", json=body) as resp:
                    assert resp.status == 200, await resp.text()

            tg.start_soon(load_late)
            try:
                samples = await client.get(4)
            finally:
                unload = {"lora_name": name}
                await session.post(f"{served[0]}/v1/unload_lora_adapter", json=unload)
        assert len(samples) == 4 and {s.version for s in samples} == {1}
        assert client.stats()["rollout/retries_total"] >= 2

        # never served again, but the trainer's next policy comes
        proxy.requests = 0
        client = client_for(served, make_dataset(tiny_model, 1), url=url, adapter_wait_s=60)
        client.set_policy("rollout-test-gone-v3", 3)
        async with client:

            async def next_policy() -> None:
                await _after_refusals(proxy, 2)
                client.set_policy(served[1], 4)

            async with anyio.create_task_group() as tg:
                tg.start_soon(next_policy)
                samples = await client.get(4)
        assert len(samples) == 4 and {s.version for s in samples} == {4}

        # neither: an error once adapter_wait_s has passed
        client = client_for(served, make_dataset(tiny_model, 1), url=url, adapter_wait_s=1.5)
        client.set_policy("rollout-test-gone-v5", 5)
        with anyio.fail_after(30), pytest.raises(ReplicaError) as caught:
            async with client:
                await client.get(4)
        assert "HTTP 404 for model 'rollout-test-gone-v5'" in str(caught.value)
        assert re.search(
            r"waited \d+ s for it to be served or for the next policy", str(caught.value)
        ), caught.value


async def test_generates_under_a_loaded_lora_adapter(served, tiny_model, lora_adapter) -> None:
    name = "rollout-test-lora-v1"
    url = served[0]
    async with aiohttp.ClientSession() as session:
        async with session.post(
            f"{url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(lora_adapter)}
        ) as resp:
            assert resp.status == 200, await resp.text()
        try:
            by_policy = {}
            for policy in ((served[1], 0), (name, 1)):
                gen = {"seed": 7, "max_completion_length": 6}
                client = client_for(served, make_dataset(tiny_model, 1), generation=gen)
                client.set_policy(*policy)
                async with client:
                    by_policy[policy[1]] = await client.get(4)
        finally:
            async with session.post(
                f"{url}/v1/unload_lora_adapter", json={"lora_name": name}
            ) as resp:
                assert resp.status == 200, await resp.text()
    assert {s.version for s in by_policy[1]} == {1}
    base_lp = [s.logprobs[0] for s in by_policy[0]]
    lora_lp = [s.logprobs[0] for s in by_policy[1]]
    assert base_lp != lora_lp, "the adapter's logprobs must differ from the base model's"
