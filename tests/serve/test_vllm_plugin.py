"""asyncgrpo's vLLM endpoint plugin on the session's two real replicas: each replica fetches
published versions from the transport itself, verifies them, and refuses what it must.

The replicas allow every transport under the session's temporary directory (tests/conftest.py);
each test publishes into its own ``tmp_path`` store. Replicas are shared: every adapter loaded
here is unloaded, names are unique.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import aiohttp
import anyio
import pytest

from asyncgrpo.errors import ReplicaHTTPError, SyncError
from asyncgrpo.proxy import ProxyConfig, serve_proxy
from asyncgrpo.run.preflight import check_adapter_fetching
from asyncgrpo.run.sync import AdapterSync, ProxyLoader, TransportSource
from asyncgrpo.serve import Replica
from asyncgrpo.serve.adapter_fetch import adapter_uri
from asyncgrpo.store.adapters import AdapterStore
from asyncgrpo.testing import make_lora_adapter, reference_logprobs
from asyncgrpo.transport import open_transport
from asyncgrpo.vllm.client import VLLMClient

pytestmark = [pytest.mark.anyio, pytest.mark.vllm]

PROMPT = [5, 17, 42, 99, 123, 7]


def _name() -> str:
    return f"fetch-{uuid.uuid4().hex[:8]}"


async def _publish(tmp_path: Path, tiny_model: Path, name: str, version: int, seed: int) -> str:
    adapter = await anyio.to_thread.run_sync(
        lambda: make_lora_adapter(tiny_model, tmp_path / f"src-{version}", seed=seed)
    )
    store = AdapterStore(open_transport(str(tmp_path / "store")))
    await store.publish(name, version, adapter)
    return adapter_uri(store.transport.url, store.prefix, name, version)


async def _served_logprob_error(url: str, model: str, tiny_model: Path, adapter: Path) -> float:
    async with VLLMClient(url) as client:
        body = await client.completions(
            {
                "model": model,
                "prompt": PROMPT,
                "max_tokens": 8,
                "temperature": 1.0,
                "logprobs": 0,
                "return_token_ids": True,
                "seed": None,
            }
        )
    choice = body["choices"][0]
    ours = await anyio.to_thread.run_sync(
        lambda: reference_logprobs(tiny_model, adapter, PROMPT, choice["token_ids"])
    )
    served = choice["logprobs"]["token_logprobs"]
    return max(abs(a - b) for a, b in zip(ours, served, strict=True))


async def _cached(url: str) -> list[str]:
    async with VLLMClient(url) as client:
        (entry,) = await client.adapter_plugin_info()
    return entry["info"]["cached"]


async def test_a_replica_fetches_verifies_and_serves_the_version_itself(
    vllm_replicas: list[Replica], tiny_model: Path, tmp_path: Path
) -> None:
    url = vllm_replicas[0].url
    name = _name()
    uri = await _publish(tmp_path, tiny_model, name, 3, seed=5)
    async with VLLMClient(url) as client:
        (entry,) = await client.adapter_plugin_info()
        check_adapter_fetching([entry], open_transport(str(tmp_path / "store")).url)
        await client.load_lora_adapter_from(f"{name}-v3", uri)
        try:
            assert f"{name}-v3" in await client.models()
            assert f"{name}-v3" in await _cached(url)
            # no load in progress once answered (a returning replica's catch-up waits for any)
            (entry,) = await client.adapter_plugin_info()
            assert entry["info"]["loading"] == []
            error = await _served_logprob_error(url, f"{name}-v3", tiny_model, tmp_path / "src-3")
            assert error < 1e-4
            # A second load under the same name is refused before anything is fetched.
            with pytest.raises(ReplicaHTTPError, match="already been loaded"):
                await client.load_lora_adapter_from(f"{name}-v3", uri)
        finally:
            await client.unload_fetched_adapter(f"{name}-v3")
        assert f"{name}-v3" not in await client.models()
        assert f"{name}-v3" not in await _cached(url)  # the cache holds what vLLM serves


async def test_a_uri_outside_the_allow_list_is_refused_and_nothing_is_fetched(
    vllm_replicas: list[Replica], tmp_path: Path
) -> None:
    url = vllm_replicas[0].url
    before = await _cached(url)
    async with VLLMClient(url) as client:
        for uri, status in (
            ("file:///etc/adapters/x/v1", 403),
            ("s3://some-bucket/run/adapters/x/v1", 403),
            (f"{open_transport(str(tmp_path)).url}/adapters/x/v1?endpoint=http://evil", 403),
        ):
            with pytest.raises(ReplicaHTTPError) as info:
                await client.load_lora_adapter_from(_name(), uri)
            assert info.value.status == status
            assert "allowed transports" in info.value.body or "no query" in info.value.body
    assert await _cached(url) == before
    # The replica's own check names the fix for a transport it was not started with.
    with pytest.raises(ValueError, match="start it with --transport s3://some-bucket/run"):
        async with VLLMClient(url) as client:
            check_adapter_fetching(await client.adapter_plugin_info(), "s3://some-bucket/run")


async def test_a_tampered_version_fails_the_sync_naming_the_file_and_no_replica_serves_it(
    vllm_replicas: list[Replica], tiny_model: Path, tmp_path: Path
) -> None:
    urls = [r.url for r in vllm_replicas]
    name = _name()
    store = AdapterStore(open_transport(str(tmp_path / "store")))
    adapter = await anyio.to_thread.run_sync(
        lambda: make_lora_adapter(tiny_model, tmp_path / "src", seed=2)
    )
    # Version 0 loads fine; version 1's weights are altered after publishing.
    async with (
        serve_proxy(ProxyConfig(upstreams=tuple(urls), port=0, load_deadline_s=5)) as base,
        VLLMClient(base) as client,
    ):
        sync = AdapterSync(
            store=store,
            source=TransportSource(store),
            loader=ProxyLoader(client, fetching=True),
            prefix=name,
            max_staleness=2,
        )
        try:
            await sync.sync(0, adapter, step=0)
            await store.publish(name, 1, adapter)
            victim = next((tmp_path / "store").rglob("v1/files-*/adapter_model.safetensors"))
            victim.write_bytes(victim.read_bytes()[:-8] + b"tampered")
            with pytest.raises(SyncError, match=r"adapter_model\.safetensors") as info:
                await sync._load_everywhere(f"{name}-v1", await sync.source.locate(name, 1))
            assert "version 1" in str(info.value)
            for url in urls:
                async with VLLMClient(url) as direct:
                    served = await direct.models()
                assert f"{name}-v1" not in served and f"{name}-v0" in served
            # The replicas keep serving the version they had.
            for url in urls:
                assert await _served_logprob_error(url, f"{name}-v0", tiny_model, adapter) < 1e-4
        finally:
            await sync.unload_all()


async def test_a_load_waits_for_a_version_that_is_not_published_yet(
    vllm_replicas: list[Replica], tiny_model: Path, tmp_path: Path
) -> None:
    urls = [r.url for r in vllm_replicas]
    name = _name()
    adapter = await anyio.to_thread.run_sync(
        lambda: make_lora_adapter(tiny_model, tmp_path / "src", seed=4)
    )
    store = AdapterStore(open_transport(str(tmp_path / "store")))
    uri = adapter_uri(store.transport.url, store.prefix, name, 0)
    cfg = ProxyConfig(upstreams=tuple(urls), port=0, load_deadline_s=20, load_retry_interval_s=0.2)
    async with serve_proxy(cfg) as base, VLLMClient(base) as client:
        async with anyio.create_task_group() as tg:
            tg.start_soon(client.load_lora_adapter_from, f"{name}-v0", uri)
            await anyio.sleep(1.0)  # the replicas have asked at least once by now
            await store.publish(name, 0, adapter)
        try:
            for url in urls:
                async with VLLMClient(url) as direct:
                    assert f"{name}-v0" in await direct.models()
        finally:
            await client.unload_fetched_adapter(f"{name}-v0")
        # Never published: the proxy answers 504 after its deadline, not a 404.
        short = ProxyConfig(upstreams=tuple(urls), port=0, load_deadline_s=1.0)
        async with serve_proxy(short) as base2, VLLMClient(base2) as client2:
            with pytest.raises(ReplicaHTTPError) as info:
                await client2.load_lora_adapter_from(
                    f"{name}-v9", adapter_uri(store.transport.url, store.prefix, name, 9)
                )
            assert info.value.status == 504


async def test_a_replica_joining_mid_run_fetches_the_current_version_itself(
    vllm_replicas: list[Replica], tiny_model: Path, tmp_path: Path
) -> None:
    first, second = (r.url for r in vllm_replicas)
    name = _name()
    uri = await _publish(tmp_path, tiny_model, name, 0, seed=6)
    cfg = ProxyConfig(upstreams=(first,), port=0, admin_api_key="admin-test-key")
    admin = {"Authorization": "Bearer admin-test-key"}
    async with serve_proxy(cfg) as base:
        async with VLLMClient(base) as client:
            await client.load_lora_adapter_from(f"{name}-v0", uri)
            try:
                async with (
                    aiohttp.ClientSession() as s,
                    s.post(base + "/proxy/upstreams", json={"url": second}, headers=admin) as r,
                ):
                    assert r.status == 200, await r.text()
                assert f"{name}-v0" in await _cached(second)
                error = await _served_logprob_error(
                    second, f"{name}-v0", tiny_model, tmp_path / "src-0"
                )
                assert error < 1e-4
            finally:
                await client.unload_fetched_adapter(f"{name}-v0")


async def _load(url: str, body: dict) -> tuple[int, str]:
    async with aiohttp.ClientSession() as s, s.post(f"{url}/v1/asyncgrpo/load", json=body) as r:
        return r.status, await r.text()


async def test_a_served_name_cannot_be_given_other_weights(
    vllm_replicas: list[Replica], tiny_model: Path, tmp_path: Path
) -> None:
    """``load_inplace`` and a ``lora_name`` that is not the URI's version
    would swap the weights behind a name in use (vLLM keys its prefix cache by name); a bad
    adapter name in the URI is a 4xx, not a server error (item 11)."""
    url = vllm_replicas[0].url
    name = _name()
    uri0 = await _publish(tmp_path, tiny_model, name, 0, seed=7)
    uri1 = await _publish(tmp_path, tiny_model, name, 1, seed=8)
    async with VLLMClient(url) as client:
        await client.load_lora_adapter_from(f"{name}-v0", uri0)
        try:
            status, text = await _load(
                url, {"lora_name": f"{name}-v0", "lora_uri": uri1, "load_inplace": True}
            )
            assert status == 400 and "load_inplace" in text, text
            status, text = await _load(url, {"lora_name": f"{name}-v7", "lora_uri": uri1})
            assert status == 400 and f"{name}-v1" in text, text
            assert f"{name}-v7" not in await client.models()
            error = await _served_logprob_error(url, f"{name}-v0", tiny_model, tmp_path / "src-0")
            assert error < 1e-4  # still version 0's weights
            bad = uri1.replace(f"/{name}/", "/" + "x" * 200 + "/")
            status, text = await _load(url, {"lora_name": "x" * 200 + "-v1", "lora_uri": bad})
            assert status == 403 and "adapter name" in text, text
        finally:
            await client.unload_fetched_adapter(f"{name}-v0")
