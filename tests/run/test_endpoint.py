"""A run nests no proxy inside a standalone one it is given (asyncgrpo.run.endpoint).

Real proxies and a real HTTP server on loopback; no replica is needed to tell them apart.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from threaded_app import serving_app

from asyncgrpo.config.proxy import ProxyConfig
from asyncgrpo.config.training import TrainingConfig
from asyncgrpo.errors import ConfigError
from asyncgrpo.proxy.server import serve_proxy
from asyncgrpo.run.endpoint import open_endpoint, upstream_key

pytestmark = pytest.mark.anyio

DEAD = "http://127.0.0.1:9"


def run_config(upstream: str, **proxy: str) -> TrainingConfig:
    return TrainingConfig.from_dict(
        {
            "model": "m",
            "dataset": {"prompts": ["p"]},
            "serve": {"replicas": 0},
            "proxy": {"upstreams": [upstream], **proxy},
        }
    )


@asynccontextmanager
async def plain_server() -> AsyncIterator[str]:
    """An HTTP server that is not a proxy (like vLLM, it has no /proxy/upstreams)."""
    async with serving_app(web.Application()) as url:
        yield url


async def upstreams_of(url: str) -> list[str]:
    async with aiohttp.ClientSession() as s, s.get(f"{url}/proxy/upstreams") as resp:
        return [u["url"] for u in (await resp.json())["upstreams"]]


async def test_a_standalone_proxy_is_used_directly(tmp_path: Path) -> None:
    async with serve_proxy(ProxyConfig(upstreams=(DEAD,), port=0, api_key="k")) as proxy:
        cfg = run_config(proxy, upstream_api_key="k")
        async with open_endpoint(cfg, tmp_path, str(tmp_path)) as endpoint:
            assert (endpoint.url, endpoint.api_key, endpoint.standalone) == (proxy, "k", True)
        with pytest.raises(ConfigError, match="upstream_api_key"):
            async with open_endpoint(run_config(proxy), tmp_path, str(tmp_path)):
                pass


async def test_a_replica_url_gets_a_proxy_of_the_runs_own(tmp_path: Path) -> None:
    async with plain_server() as server:
        async with open_endpoint(run_config(server), tmp_path, str(tmp_path)) as endpoint:
            assert endpoint.url != server and not endpoint.standalone
            assert await upstreams_of(endpoint.url) == [server]


async def test_the_runs_proxy_sends_the_key_of_the_replicas_it_starts(tmp_path: Path) -> None:
    """Replicas a run starts with serve.api_key answer 401 to a proxy without it (it sent none);
    a different proxy.upstream_api_key is refused before any replica starts."""

    def cfg(replicas: int, **keys: str) -> TrainingConfig:
        serve = {"replicas": replicas, **({"api_key": keys["serve"]} if "serve" in keys else {})}
        proxy = {"upstreams": [DEAD], **({"upstream_api_key": keys["up"]} if "up" in keys else {})}
        return TrainingConfig.from_dict(
            {"model": "m", "dataset": {"prompts": ["p"]}, "serve": serve, "proxy": proxy}
        )

    assert upstream_key(cfg(1, serve="k")) == "k"
    assert upstream_key(cfg(1, serve="k", up="k")) == "k"
    assert upstream_key(cfg(1, up="u")) == "u"
    assert upstream_key(cfg(0, serve="k")) is None  # no replica of its own: the key is theirs
    assert upstream_key(cfg(0, serve="k", up="u")) == "u"
    with pytest.raises(ConfigError, match=r"serve\.api_key and proxy\.upstream_api_key differ"):
        async with open_endpoint(cfg(1, serve="k", up="u"), tmp_path, str(tmp_path)):
            pass
