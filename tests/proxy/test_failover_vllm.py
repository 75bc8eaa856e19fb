"""Replicas that die under load: the proxy must fail over, never hang, and stop routing to them.

These tests start two replicas of their own (they kill them), next to the session's shared ones.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from test_proxy_vllm import grpo_prompts, model_name

from asyncgrpo.proxy import ProxyConfig, serve_proxy
from asyncgrpo.proxy.http.headers import REPLICA_HEADER
from asyncgrpo.serve import Replica, ServeConfig, launch_replicas

pytestmark = [pytest.mark.anyio, pytest.mark.vllm]


@pytest.fixture(scope="module")
def own_replicas(
    tiny_model: Path, vllm_replicas: list[Replica], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[Replica]]:
    """Two more replicas serving the shared ones' model under the same name."""
    from anyio.from_thread import start_blocking_portal

    with urllib.request.urlopen(vllm_replicas[0].url + "/v1/models", timeout=30) as r:
        served = json.load(r)["data"][0]["id"]

    config = ServeConfig(
        model=str(tiny_model),
        replicas=2,
        dtype="float32",
        max_model_len=1024,
        kv_cache_gib=1,
        max_staleness=2,
        startup_timeout_s=600,
        log_dir=str(tmp_path_factory.mktemp("failover-logs")),
        extra_args=["--served-model-name", served],
    )
    with (
        start_blocking_portal() as portal,
        portal.wrap_async_context_manager(launch_replicas(config)) as replicas,
    ):
        yield replicas


async def _stats(s: aiohttp.ClientSession, base: str) -> dict:
    async with s.get(base + "/proxy/stats") as r:
        return await r.json()


def _upstream(stats: dict, url: str) -> dict:
    return next(u for u in stats["upstreams"] if u["url"] == url)


async def _load(
    base: str, model: str, n_prompts: int, max_tokens: int, inflight: int, seed: int
) -> list[tuple[int, str, float]]:
    """GRPO-shaped load through the proxy; returns (status, replica, finish time) per request."""
    prompts = grpo_prompts(n_prompts, seed)
    sem = asyncio.Semaphore(inflight)
    out: list[tuple[int, str, float]] = []

    async def one(s: aiohttp.ClientSession, p: list[int]) -> None:
        body = {"model": model, "prompt": p, "max_tokens": max_tokens, "ignore_eos": True}
        async with sem, s.post(base + "/v1/completions", json=body) as r:
            await r.read()
            out.append((r.status, r.headers.get(REPLICA_HEADER, ""), time.monotonic()))

    async with aiohttp.ClientSession() as s:
        await asyncio.gather(*(one(s, p) for p in prompts for _ in range(8)))
    return out


async def _wait_for_traffic(base: str, url: str, n: int) -> None:
    async with aiohttp.ClientSession() as s:
        for _ in range(600):
            if _upstream(await _stats(s, base), url)["routed"] >= n:
                return
            await asyncio.sleep(0.05)
    raise AssertionError(f"{url} never received {n} requests")


async def _warm(url: str, model: str) -> None:
    async with aiohttp.ClientSession() as s:
        body = {"model": model, "prompt": [11, 12, 13], "max_tokens": 1}
        async with s.post(url + "/v1/completions", json=body) as r:
            assert r.status == 200


async def test_killed_replica_leaves_rotation(
    vllm_replicas: list[Replica], own_replicas: list[Replica]
) -> None:
    victim = own_replicas[0]
    healthy = vllm_replicas[0]
    model = await model_name(healthy.url)
    await _warm(victim.url, model)
    cfg = ProxyConfig(
        upstreams=(healthy.url, victim.url), port=0, health_interval_s=0.5, request_timeout_s=60
    )
    async with serve_proxy(cfg) as base, aiohttp.ClientSession() as s:
        load = asyncio.create_task(_load(base, model, 12, 16, 24, seed=11))
        await _wait_for_traffic(base, victim.url, 12)
        victim.kill()
        killed_at = time.monotonic()
        results = await asyncio.wait_for(load, 120)
        assert [st for st, _, _ in results if st != 200] == []  # every request failed over
        stats = await _stats(s, base)
        up = _upstream(stats, victim.url)
        assert up["circuit"] == "open", up
        assert sum(up["failures"].values()) >= 1
        # Nothing that finished well after the kill was served by the dead replica.
        assert not [r for _, r, t in results if r == victim.url and t > killed_at + 1]
        routed = up["routed"]
        later = await _load(base, model, 4, 2, 16, seed=12)
        await asyncio.sleep(1.5)  # health checks keep probing it: still refused
        assert {r for _, r, _ in later} == {healthy.url}
        assert all(st == 200 for st, _, _ in later)
        up = _upstream(await _stats(s, base), victim.url)
        assert up["routed"] == routed and up["circuit"] == "open"
        async with s.get(base + "/health") as r:  # the fleet still serves; the body says who not
            doc = await r.json()
            assert r.status == 200 and doc["serving"] == 1
            assert [u["url"] for u in doc["unhealthy"]] == [victim.url]


async def test_sigterm_draining_replica_requests_hit_deadline_and_retry(
    vllm_replicas: list[Replica], own_replicas: list[Replica]
) -> None:
    victim = own_replicas[1]
    healthy = vllm_replicas[1]
    model = await model_name(healthy.url)
    await _warm(victim.url, model)
    cfg = ProxyConfig(
        upstreams=(healthy.url, victim.url),
        port=0,
        health_interval_s=0.5,
        request_timeout_s=20.0,  # a draining replica's requests hang until then, or get a 500
    )
    async with serve_proxy(cfg) as base, aiohttp.ClientSession() as s:
        load = asyncio.create_task(_load(base, model, 12, 48, 24, seed=21))
        await _wait_for_traffic(base, victim.url, 12)
        victim.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        results = await asyncio.wait_for(load, 120)
        elapsed = time.monotonic() - t0
        assert [st for st, _, _ in results if st != 200] == []
        up = _upstream(await _stats(s, base), victim.url)
        assert up["circuit"] in ("open", "half_open"), up
        assert sum(up["failures"].values()) >= 1
        print(f"SIGTERM: all {len(results)} requests done {elapsed:.1f} s after the signal; {up}")
        assert elapsed < 90
