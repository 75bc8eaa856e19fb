"""A replica reachable from other machines answers nothing but ``/health``
without its key. vLLM's own ``--api-key`` guards only ``/v1``-style paths, so its development
routes (``VLLM_SERVER_DEV_MODE=1``: ``/collective_rpc``, ``/sleep``, ``/pause``, ...) were open."""

from __future__ import annotations

import ipaddress
import secrets
from pathlib import Path

import aiohttp
import pytest

from asyncgrpo.serve import Replica, launch_replicas
from asyncgrpo.testing import tiny_serve_config

pytestmark = [pytest.mark.anyio, pytest.mark.vllm]

#: Every kind of route: development ones (the sync uses pause/resume/server_info), vLLM's
#: unguarded metrics and docs, the plugin's, and a path no route has.
ROUTES = [
    ("POST", "/collective_rpc", {"method": "check_health"}),
    ("GET", "/server_info", None),
    ("POST", "/pause", None),
    ("POST", "/resume", None),
    ("POST", "/sleep", None),
    ("POST", "/reset_prefix_cache", None),
    ("GET", "/metrics", None),
    ("GET", "/openapi.json", None),
    ("GET", "/v1/models", None),
    ("GET", "/v1/asyncgrpo/info", None),
    ("GET", "/no/such/route", None),
]


def _other_addresses() -> list[str]:
    """This host's non-loopback IPv4 addresses (the replica binds 0.0.0.0: all of them)."""
    import psutil

    found = []
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family.name == "AF_INET" and not ipaddress.ip_address(a.address).is_loopback:
                found.append(a.address)
    return found


async def test_a_replica_beyond_loopback_needs_its_key_on_every_route_but_health(
    tiny_model: Path, tmp_path: Path
) -> None:
    key = secrets.token_urlsafe(16)
    config = tiny_serve_config(
        tiny_model,
        replicas=1,
        host="0.0.0.0",
        api_key=key,
        log_dir=str(tmp_path / "logs"),
        adapter_cache_dir=str(tmp_path / "cache"),
    )
    async with launch_replicas(config) as (replica,), aiohttp.ClientSession() as session:
        bases = [replica.url, *(f"http://{a}:{replica.port}" for a in _other_addresses())]
        for base in bases:
            for method, path, body in ROUTES:
                async with session.request(method, base + path, json=body) as r:
                    assert r.status == 401, f"{method} {base}{path} answered {r.status}"
                for header in ({"Authorization": "Bearer wrong"}, {"Authorization": key}):
                    async with session.request(method, base + path, json=body, headers=header) as r:
                        assert r.status == 401, f"{method} {path} {header}: {r.status}"
            async with session.get(base + "/health") as r:
                assert r.status == 200
        auth = {"Authorization": f"Bearer {key}"}
        async with session.post(
            replica.url + "/collective_rpc", json={"method": "check_health"}, headers=auth
        ) as r:
            assert r.status == 200 and await r.json() == {"results": [None]}
        async with session.get(replica.url + "/server_info", headers=auth) as r:
            assert r.status == 200 and "vllm_config" in await r.text()
        from asyncgrpo.serve.replicas import dev_routes_open

        assert not await dev_routes_open(replica.url)


async def test_an_unguarded_replica_is_recognised(vllm_replicas: list[Replica]) -> None:
    """The check a replica beyond loopback must pass at start: the session's loopback
    replicas have no key, so their development routes answer anyone, and it says so."""
    from asyncgrpo.serve.replicas import dev_routes_open

    assert await dev_routes_open(vllm_replicas[0].url)
