"""The proxy in front of the session's two real vLLM replicas: routing, broadcast, streaming,
bad input. Replicas are shared: every adapter loaded here is unloaded, names are unique."""

from __future__ import annotations

import asyncio
import json
import random
import uuid
from pathlib import Path

import aiohttp
import pytest

from asyncgrpo.proxy import ProxyConfig, serve_proxy
from asyncgrpo.proxy.http.headers import REPLICA_HEADER
from asyncgrpo.serve import Replica
from asyncgrpo.testing.vllm_metrics import prefix_cache, samples
from asyncgrpo.vllm.client import VLLMClient

pytestmark = [pytest.mark.anyio, pytest.mark.vllm]

G = 8
JSON = {"Content-Type": "application/json"}


def grpo_prompts(n: int, seed: int, template_len: int = 151) -> list[list[int]]:
    """Token-id prompts shaped like GRPO rollouts: one shared template, then 128-256 own tokens."""
    rng = random.Random(seed)
    template = [rng.randrange(10, 300) for _ in range(template_len)]
    return [
        template + [rng.randrange(10, 300) for _ in range(rng.randrange(128, 257))]
        for _ in range(n)
    ]


async def model_name(url: str) -> str:
    async with aiohttp.ClientSession() as s, s.get(url + "/v1/models") as r:
        return (await r.json())["data"][0]["id"]


async def run_groups(
    base: str, model: str, prompts: list[list[int]], inflight: int
) -> dict[int, set[str]]:
    """G requests per prompt, at most ``inflight`` at once; returns prompt -> replicas used."""
    sem = asyncio.Semaphore(inflight)
    where: dict[int, set[str]] = {}

    async def one(s: aiohttp.ClientSession, i: int) -> None:
        body = {"model": model, "prompt": prompts[i], "max_tokens": 2, "temperature": 1.0}
        async with sem, s.post(base + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            await r.read()
            where.setdefault(i, set()).add(r.headers[REPLICA_HEADER])

    async with aiohttp.ClientSession() as s:
        await asyncio.gather(*(one(s, i) for i in range(len(prompts)) for _ in range(G)))
    return where


async def test_group_affinity_beats_round_robin_on_vllm_prefix_cache(
    vllm_replicas: list[Replica],
) -> None:
    urls = [r.url for r in vllm_replicas]
    model = await model_name(urls[0])
    results = {}
    for routing, seed in (("round_robin", 1), ("affinity", 2)):
        # imbalance=32 (= requests in flight): no group can need to spill, so this checks
        # placement alone; bounded-imbalance spills are covered by the router's unit tests.
        cfg = ProxyConfig(upstreams=tuple(urls), port=0, routing=routing, imbalance=32)
        async with serve_proxy(cfg) as base, aiohttp.ClientSession() as s:
            async with s.post(base + "/reset_prefix_cache") as r:
                assert r.status == 200, await r.text()
            h0, q0 = await prefix_cache(urls)
            where = await run_groups(base, model, grpo_prompts(16, seed), inflight=32)
            h1, q1 = await prefix_cache(urls)
            async with s.get(base + "/proxy/stats") as r:
                stats = await r.json()
        results[routing] = ((h1 - h0) / (q1 - q0), where, stats)
    rr_rate, _, _ = results["round_robin"]
    aff_rate, where, stats = results["affinity"]
    assert stats["block_size"] == 128  # read from the replicas' /server_info
    # Every group of G landed on one replica, and both replicas got groups.
    split = {i: v for i, v in where.items() if len(v) > 1}
    assert not split, (split, json.dumps(stats, indent=1))
    assert {next(iter(v)) for v in where.values()} == set(urls)
    assert stats["routing"]["decisions"]["spill"] == 0
    print(f"prefix-cache hit rate: round-robin {rr_rate:.3f}, affinity {aff_rate:.3f}")
    assert aff_rate > rr_rate + 0.02


async def test_load_reaches_every_replica_and_unload_everywhere(
    vllm_replicas: list[Replica], lora_adapter: Path
) -> None:
    urls = [r.url for r in vllm_replicas]
    name = f"proxy-load-{uuid.uuid4().hex[:8]}"
    cfg = ProxyConfig(upstreams=tuple(urls), port=0, lora_roots=(str(lora_adapter.parent),))
    async with serve_proxy(cfg) as base, aiohttp.ClientSession() as s:
        body = {"lora_name": name, "lora_path": str(lora_adapter)}
        async with s.post(base + "/v1/load_lora_adapter", json=body) as r:
            assert r.status == 200, await r.text()
        try:
            for url in urls:
                async with VLLMClient(url) as c:
                    assert name in await c.models()
            prompt = grpo_prompts(1, 7)[0][:40]
            for _ in range(4):  # served under the adapter, whichever replica gets it
                req = {"model": name, "prompt": prompt, "max_tokens": 2}
                async with s.post(base + "/v1/completions", json=req) as r:
                    assert r.status == 200, await r.text()
            async with s.get(base + "/proxy/stats") as r:
                assert name in (await r.json())["adapters"]
        finally:
            async with s.post(base + "/v1/unload_lora_adapter", json={"lora_name": name}) as r:
                assert r.status == 200, await r.text()
        for url in urls:
            async with VLLMClient(url) as c:
                assert name not in await c.models()


async def test_rollback_when_one_replica_rejects_a_load(
    vllm_replicas: list[Replica], lora_adapter: Path
) -> None:
    urls = [r.url for r in vllm_replicas]
    name = f"proxy-rollback-{uuid.uuid4().hex[:8]}"
    # Replica 1 already holds the name (another adapter, as far as the proxy knows): it rejects.
    async with VLLMClient(urls[1]) as c:
        await c.load_lora_adapter(name, str(lora_adapter))
    try:
        cfg = ProxyConfig(upstreams=tuple(urls), port=0)
        async with serve_proxy(cfg) as base, aiohttp.ClientSession() as s:
            body = {"lora_name": name, "lora_path": str(lora_adapter)}
            async with s.post(base + "/v1/load_lora_adapter", json=body) as r:
                assert r.status == 400, await r.text()
                assert r.headers["X-Asyncgrpo-Replica"] == urls[1]
                assert "already" in await r.text()
        async with VLLMClient(urls[0]) as c:
            assert name not in await c.models()  # rolled back
        async with VLLMClient(urls[1]) as c:
            assert name in await c.models()  # not ours to unload
    finally:
        async with VLLMClient(urls[1]) as c:
            await c.unload_lora_adapter(name)


async def test_load_of_missing_adapter_retries_then_504(
    vllm_replicas: list[Replica], tmp_path: Path
) -> None:
    urls = [r.url for r in vllm_replicas]
    cfg = ProxyConfig(upstreams=tuple(urls), port=0, load_deadline_s=1.5, load_retry_interval_s=0.3)
    async with serve_proxy(cfg) as base, aiohttp.ClientSession() as s:
        body = {"lora_name": f"missing-{uuid.uuid4().hex[:8]}", "lora_path": str(tmp_path / "no")}
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        async with s.post(base + "/v1/load_lora_adapter", json=body) as r:
            assert r.status == 504, await r.text()
            assert "load_deadline_s" in (await r.json())["error"]["message"]
        assert 1.2 < loop.time() - t0 < 10


async def test_streaming_and_auth_through_openai_sdk(vllm_replicas: list[Replica]) -> None:
    from openai import AsyncOpenAI, AuthenticationError

    urls = [r.url for r in vllm_replicas]
    model = await model_name(urls[0])
    cfg = ProxyConfig(upstreams=tuple(urls), port=0, api_key="sekret-test-key")
    async with serve_proxy(cfg) as base:
        client = AsyncOpenAI(base_url=base + "/v1", api_key="sekret-test-key", max_retries=0)
        stream = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "hello there"}],
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in stream]
        assert len(chunks) >= 3  # role chunk, content chunks, usage chunk
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert isinstance(text, str)
        comp = await client.completions.create(model=model, prompt="abc", max_tokens=4, stream=True)
        parts = [c async for c in comp]
        assert parts and all(p.choices[0].index == 0 for p in parts if p.choices)
        models = await client.models.list()
        assert model in [m.id for m in models.data]
        bad = AsyncOpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(AuthenticationError):
            await bad.models.list()
        await client.close()
        await bad.close()


async def test_bad_input_is_rejected_clearly(vllm_replicas: list[Replica], tmp_path: Path) -> None:
    urls = [r.url for r in vllm_replicas]
    root = tmp_path / "adapters"
    root.mkdir()
    (tmp_path / "outside").mkdir()
    (root / "escape").symlink_to(tmp_path / "outside")
    cfg = ProxyConfig(upstreams=tuple(urls), port=0, lora_roots=(str(root),), max_body_bytes=4096)
    async with serve_proxy(cfg) as base, aiohttp.ClientSession() as s:
        async with s.post(base + "/v1/completions", data=b"{not json", headers=JSON) as r:
            assert r.status == 400
            assert "not valid JSON" in (await r.json())["error"]["message"]
        async with s.post(base + "/v1/completions", data=b"[1, 2]", headers=JSON) as r:
            assert r.status == 400
        async with s.post(base + "/v1/completions", data=b"x" * 5000, headers=JSON) as r:
            assert r.status == 413
        for path in ("/etc/passwd", f"{root}/../outside", "relative/path", f"{root}/escape"):
            body = {"lora_name": "x", "lora_path": path}
            async with s.post(base + "/v1/load_lora_adapter", json=body) as r:
                assert r.status == 400, path
                assert "lora_path" in (await r.json())["error"]["message"]
        async with s.delete(base + "/v1/models") as r:
            assert r.status == 404
        # vLLM's own validation errors pass through untouched.
        async with s.post(base + "/v1/completions", json={"model": "nope", "prompt": "a"}) as r:
            assert r.status == 404
            assert "nope" in await r.text()
        async with s.get(base + "/health") as r:
            assert r.status == 200
            assert (await r.json())["replicas"] == 2
        async with s.get(base + "/metrics") as r:
            m = samples(await r.text())
        names = {key.partition("{")[0] for key in m}
        for metric in (
            "asyncgrpo_proxy_routed_total",
            "asyncgrpo_proxy_inflight",
            "asyncgrpo_proxy_replica_healthy",
            "asyncgrpo_proxy_route_decisions_total",
            "asyncgrpo_proxy_tracked_blocks",
            "asyncgrpo_proxy_route_seconds_count",
        ):
            assert metric in names, metric
        assert m['asyncgrpo_proxy_rejected_total{status="413"}'] == 1
        async with s.get(base + "/server_info", params={"config_format": "json"}) as r:
            info = json.loads(await r.read())
            assert info["vllm_config"]["cache_config"]["block_size"] == 128


async def test_replica_joining_at_run_time_gets_adapters_replayed(
    vllm_replicas: list[Replica], lora_adapter: Path
) -> None:
    first, second = (r.url for r in vllm_replicas)
    name = f"proxy-join-{uuid.uuid4().hex[:8]}"
    cfg = ProxyConfig(upstreams=(first,), port=0, admin_api_key="admin-test-key")
    admin = {"Authorization": "Bearer admin-test-key"}
    async with serve_proxy(cfg) as base, aiohttp.ClientSession() as s:
        body = {"lora_name": name, "lora_path": str(lora_adapter)}
        async with s.post(base + "/v1/load_lora_adapter", json=body) as r:
            assert r.status == 200, await r.text()
        try:
            async with VLLMClient(second) as c:
                assert name not in await c.models()
            async with s.post(base + "/proxy/upstreams", json={"url": second}, headers=admin) as r:
                assert r.status == 200, await r.text()
                assert (await r.json())["adapters"] == [name]
            async with VLLMClient(second) as c:
                assert name in await c.models()  # replayed before it entered rotation
            async with s.get(base + "/proxy/upstreams") as r:
                ups = (await r.json())["upstreams"]
                assert [u["circuit"] for u in ups] == ["closed", "closed"]
        finally:
            async with s.post(base + "/v1/unload_lora_adapter", json={"lora_name": name}) as r:
                assert r.status == 200, await r.text()
        async with s.delete(base + "/proxy/upstreams", json={"url": second}, headers=admin) as r:
            assert r.status == 200
        async with s.get(base + "/proxy/stats") as r:
            assert [u["url"] for u in (await r.json())["upstreams"]] == [first]
    for url in (first, second):
        async with VLLMClient(url) as c:
            assert name not in await c.models()
