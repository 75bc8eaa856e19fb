"""The fleet: broadcasts go to the replicas in rotation; a replica that leaves does not fail them
(nor the trainer's sync); one that returns or joins catches up before it takes a request, even
while a sync runs.

Stand-in replicas (aiohttp) keep the state that matters, as vLLM does: the adapters loaded (a
completion for another model is a 404), paused or not; a stopped one refuses connections, a
restarted one has forgotten everything.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from asyncgrpo.proxy import ProxyConfig, serve_proxy
from asyncgrpo.proxy.http.headers import REPLICA_HEADER
from asyncgrpo.run.sync import AdapterSync, LocalCacheSource, ProxyLoader
from asyncgrpo.store.adapters import AdapterStore
from asyncgrpo.testing.vllm_metrics import samples
from asyncgrpo.vllm.client import VLLMClient

pytestmark = pytest.mark.anyio
ADMIN = "fleet-admin-key-0123456789"
FAST = {"health_interval_s": 0.1, "circuit_open_s": 0.1, "block_size": 16}


@dataclass
class StandIn:
    """One replica: its state, and its server while it runs."""

    port: int = 0
    adapters: set[str] = field(default_factory=set)
    paused: bool = False
    served: int = 0
    gates: dict[str, asyncio.Event] = field(default_factory=dict)  #: a load waits for it
    loading: dict[str, asyncio.Event] = field(default_factory=dict)  #: set once it waits
    refuse: dict[str, int] = field(default_factory=dict)  #: a load answers this status
    fail_unload: dict[str, int] = field(default_factory=dict)  #: unloads answered 500, per name
    #: its engine dies at the load of this adapter: "before" or "after" answering it
    die_on_load: dict[str, str] = field(default_factory=dict)
    dead: bool = False  #: drops every connection
    sick: bool = False  #: its /health answers 503 (vLLM's with a dead engine)
    hold: asyncio.Event = field(default_factory=asyncio.Event)  #: completions marked "hold"
    runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self, *, forget: bool = True) -> StandIn:
        """Serve (again: on the same port; with nothing loaded, like a restarted vLLM, unless
        it was only unreachable)."""
        if forget:
            self.adapters, self.paused = set(), False
        app = web.Application(middlewares=[self.alive])
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_post("/v1/load_lora_adapter", self.load)
        app.router.add_post("/v1/unload_lora_adapter", self.unload)
        app.router.add_post("/v1/asyncgrpo/load", self.load)  # the replica plugin's routes
        app.router.add_post("/v1/asyncgrpo/unload", self.unload)
        app.router.add_post("/pause", self.pause)
        app.router.add_post("/resume", self.resume)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/asyncgrpo/info", self.info)
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        self.port = self.runner.addresses[0][1]
        return self

    async def stop(self) -> None:
        """The machine is gone: connections refused, requests in flight cut."""
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    @web.middleware
    async def alive(self, request: web.Request, handler):
        if request.path == "/v1/load_lora_adapter":
            name = json.loads(await request.read())["lora_name"]
            self.dead = self.dead or self.die_on_load.get(name) == "before"
        if self.dead:  # what a crashed engine's host does: reset, no answer
            if request.transport is not None:
                request.transport.abort()
            return web.Response(status=500)  # never sent
        return await handler(request)

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=503 if self.sick else 200, text="")

    async def models(self, request: web.Request) -> web.Response:
        names = ["base", *sorted(self.adapters)]
        return web.json_response({"object": "list", "data": [{"id": n} for n in names]})

    async def load(self, request: web.Request) -> web.Response:
        name = (await request.json())["lora_name"]
        if name in self.adapters:
            return web.Response(
                status=400, text=f"The lora adapter '{name}' has already been loaded."
            )
        if name in self.gates:
            self.loading.setdefault(name, asyncio.Event()).set()
            await self.gates[name].wait()
        if name in self.refuse:
            return web.Response(status=self.refuse[name], text='{"error": "integrity"}')
        self.adapters.add(name)
        self.dead = name in self.die_on_load
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def info(self, request: web.Request) -> web.Response:
        """The plugin's answer, as far as the proxy reads it: the loads in progress."""
        waiting = [
            n
            for n, gate in self.gates.items()
            if n in self.loading and self.loading[n].is_set() and not gate.is_set()
        ]
        return web.json_response({"plugin": "asyncgrpo", "ok": True, "loading": waiting})

    async def unload(self, request: web.Request) -> web.Response:
        name = (await request.json())["lora_name"]
        if self.fail_unload.get(name):
            self.fail_unload[name] -= 1
            return web.Response(status=500, text="engine busy")
        if name not in self.adapters:
            return web.Response(status=404, text="not found")
        self.adapters.discard(name)
        return web.Response(text="unloaded")

    async def pause(self, request: web.Request) -> web.Response:
        self.paused = True
        return web.json_response({})

    async def resume(self, request: web.Request) -> web.Response:
        self.paused = False
        return web.json_response({})

    async def completions(self, request: web.Request) -> web.Response:
        body = await request.json()
        if body.get("hold"):
            await self.hold.wait()
        if body["model"] not in self.adapters:
            return web.Response(status=404, text=f"The model `{body['model']}` does not exist.")
        self.served += 1
        return web.json_response({"choices": [{"text": "ok"}]})


@pytest.fixture
async def fleet() -> AsyncIterator[list[StandIn]]:
    replicas = [await StandIn().start(), await StandIn().start()]
    try:
        yield replicas
    finally:
        for r in replicas:
            r.hold.set()
            for gate in r.gates.values():
                gate.set()
            await r.stop()


class Client:
    def __init__(self, session: aiohttp.ClientSession, base: str) -> None:
        self.session, self.base = session, base

    async def post(self, path: str, body: object = None, key: str | None = None) -> tuple[int, str]:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        async with self.session.post(self.base + path, json=body, headers=headers) as r:
            return r.status, await r.text()

    async def load(self, name: str) -> tuple[int, str]:
        return await self.post(
            "/v1/load_lora_adapter", {"lora_name": name, "lora_path": f"/a/{name}"}
        )

    async def get(self, path: str) -> tuple[int, dict | str]:
        async with self.session.get(self.base + path) as r:
            text = await r.text()
            return r.status, json.loads(text) if path != "/metrics" else text

    async def upstream(self, url: str) -> dict:
        _, stats = await self.get("/proxy/stats")
        return next(u for u in stats["upstreams"] if u["url"] == url)  # type: ignore[index]

    async def wait_circuit(self, url: str, *states: str) -> dict:
        for _ in range(200):
            if (up := await self.upstream(url))["circuit"] in states:
                return up
            await asyncio.sleep(0.05)
        raise AssertionError(f"{url} never {states}: {await self.upstream(url)}")


async def test_a_member_lost_leaves_the_fleet_without_failing_a_sync(
    fleet: list[StandIn],
) -> None:
    """Its machine goes just before a sync, before anything noticed: every broadcast of the
    sync succeeds on the fleet left."""
    a, b = fleet
    cfg = ProxyConfig(
        upstreams=(a.url, b.url),
        port=0,
        routing="round_robin",
        **{**FAST, "health_interval_s": 3600},
    )
    async with serve_proxy(cfg) as base, aiohttp.ClientSession() as session:
        c = Client(session, base)
        assert (await c.load("v1"))[0] == 200
        assert a.adapters == b.adapters == {"v1"}
        await b.stop()
        assert (await c.post("/pause?mode=keep"))[0] == 200
        assert (await c.load("v2"))[0] == 200
        assert (await c.post("/resume"))[0] == 200
        assert (await c.post("/v1/unload_lora_adapter", {"lora_name": "v1"}))[0] == 200
        assert a.adapters == {"v2"} and not a.paused
        status, health = await c.get("/health")
        assert status == 200 and health["serving"] == 1  # type: ignore[index]
        assert [u["url"] for u in health["unhealthy"]] == [b.url]  # type: ignore[index]
        _, metrics = await c.get("/metrics")
        m = samples(metrics)  # type: ignore[arg-type]
        assert m['asyncgrpo_proxy_broadcasts_total{endpoint="pause",outcome="ok"}'] == 1
        assert not [k for k in m if "broadcasts_total" in k and 'outcome="failed"' in k]
        assert m["asyncgrpo_proxy_replicas_in_rotation"] == 1
        assert m['asyncgrpo_proxy_fleet_changes_total{change="left"}'] == 1
        assert (await c.post("/v1/completions", {"model": "v2"}))[0] == 200
        await b.start()  # not back: no health check has run since
        assert (await c.load("v3"))[0] == 200 and "v3" not in b.adapters


async def test_a_returner_catching_up_while_a_sync_runs_enters_with_the_new_version(
    fleet: list[StandIn],
) -> None:
    """Its machine goes with a request in flight, which is redone on the other. On its return
    the replay of v1 to it is slow (a fetch); meanwhile v2 is loaded and v1 retired. It must
    come back holding v2 (a completion for v2 routed to it would be a 404) and not v1."""
    a, b = fleet
    cfg = ProxyConfig(upstreams=(a.url, b.url), port=0, routing="round_robin", **FAST)
    async with serve_proxy(cfg) as base, aiohttp.ClientSession() as session:
        c = Client(session, base)
        assert (await c.load("v1"))[0] == 200
        held = [
            asyncio.create_task(c.post("/v1/completions", {"model": "v1", "hold": True}))
            for _ in range(2)
        ]
        await asyncio.sleep(0.2)  # one on each
        a.hold.set()
        await b.stop()
        assert [(await h)[0] for h in held] == [200, 200]  # the one on b, redone on a
        await c.wait_circuit(b.url, "open")  # its health check failed: out of the fleet
        b.gates["v1"] = asyncio.Event()
        await b.start()
        b.loading["v1"] = loading = asyncio.Event()
        await asyncio.wait_for(loading.wait(), 10)  # its catch-up is replaying v1
        assert (await c.load("v2"))[0] == 200  # a sync does not wait for it
        assert (await c.post("/v1/unload_lora_adapter", {"lora_name": "v1"}))[0] == 200
        assert a.adapters == {"v2"} and b.adapters == set()
        b.gates["v1"].set()
        await c.wait_circuit(b.url, "half_open", "closed")
        assert b.adapters == {"v2"}
        answers = [await c.post("/v1/completions", {"model": "v2"}) for _ in range(6)]
        assert [s for s, _ in answers] == [200] * 6 and b.served > 0
        assert (await c.upstream(b.url))["circuit"] == "closed"
        _, stats = await c.get("/proxy/stats")
        counted = stats["fleet"]  # type: ignore[index]
        assert counted["rejoins_total"] == 1 and counted["in_rotation"] == 2
        assert counted["lost_requests_total"] == 1 and counted["lost_generation_s_total"] > 0
        # a live replica refusing a version fails the load, rolled back everywhere
        b.refuse["v3"] = 422
        status, _ = await c.load("v3")
        assert status == 422 and "v3" not in a.adapters | b.adapters


async def test_a_live_replica_answering_500_to_a_load_refused_it_and_stays(
    fleet: list[StandIn],
) -> None:
    """vLLM answers 500 to an adapter it cannot apply (a LoRA on lm_head): the load fails with
    that answer, rolled back, and both replicas stay in the fleet (before, a 500 made each
    leave, the load answered "no replica could be reached", and generation stopped)."""
    a, b = fleet
    cfg = ProxyConfig(upstreams=(a.url, b.url), port=0, **{**FAST, "health_interval_s": 3600})
    async with serve_proxy(cfg) as base, aiohttp.ClientSession() as session:
        c = Client(session, base)
        a.refuse["bad"] = b.refuse["bad"] = 500
        status, text = await c.load("bad")
        assert (status, text) == (500, '{"error": "integrity"}')
        assert [(await c.upstream(r.url))["circuit"] for r in fleet] == ["closed", "closed"]
        assert (await c.load("v1"))[0] == 200 and a.adapters == b.adapters == {"v1"}
        b.refuse["v2"], b.sick = 500, True  # a 500 from a dead engine: it leaves
        assert (await c.load("v2"))[0] == 200 and a.adapters == {"v1", "v2"}
        assert (await c.upstream(b.url))["circuit"] == "open"


async def test_a_replica_that_was_only_unreachable_unloads_what_was_retired_meanwhile(
    fleet: list[StandIn],
) -> None:
    """Its vLLM kept running (a network partition): it still holds v1, which the fleet retired
    while it was away; it comes back holding v2 only (no LoRA slot taken by a dead version)."""
    a, b = fleet
    cfg = ProxyConfig(upstreams=(a.url, b.url), port=0, **FAST)
    async with serve_proxy(cfg) as base, aiohttp.ClientSession() as session:
        c = Client(session, base)
        assert (await c.load("v1"))[0] == 200
        await b.stop()
        await c.wait_circuit(b.url, "open")
        assert (await c.load("v2"))[0] == 200
        assert (await c.post("/v1/unload_lora_adapter", {"lora_name": "v1"}))[0] == 200
        assert b.adapters == {"v1"}
        await b.start(forget=False)
        await c.wait_circuit(b.url, "half_open", "closed")
        assert a.adapters == b.adapters == {"v2"}


async def test_a_load_that_lands_after_its_replica_left_is_unloaded_when_it_returns(
    fleet: list[StandIn],
) -> None:
    """A load the proxy stopped waiting for (``broadcast_timeout_s``) goes on on the replica,
    which left the fleet; the version is retired meanwhile. The replica's catch-up waits for
    that load to land before it reads what the replica serves, so it unloads it: the replica
    comes back holding what the fleet serves, nothing more (with fetching replicas, nothing
    left in its cache either)."""
    a, b = fleet
    b.gates["v1"] = asyncio.Event()
    cfg = ProxyConfig(upstreams=(a.url, b.url), port=0, broadcast_timeout_s=0.5, **FAST)
    async with serve_proxy(cfg) as base, aiohttp.ClientSession() as session:
        c = Client(session, base)
        assert (await c.load("v1"))[0] == 200  # a took it; b did not answer in time and left
        assert (await c.upstream(b.url))["circuit"] == "open"
        assert (await c.load("v2"))[0] == 200
        assert (await c.post("/v1/unload_lora_adapter", {"lora_name": "v1"}))[0] == 200
        await asyncio.sleep(1.0)  # b answers its health checks: not back while v1 is loading
        assert (await c.upstream(b.url))["circuit"] == "open"
        b.gates["v1"].set()
        await c.wait_circuit(b.url, "half_open", "closed")
        assert a.adapters == b.adapters == {"v2"}


async def test_a_load_taken_back_is_unloaded_from_a_replica_that_missed_the_take_back(
    fleet: list[StandIn],
) -> None:
    """All or nothing: a refuses v1, so the proxy takes it back from those that took it; b did
    not answer in time, left the fleet, and loads v1 after all: it unloads it when it returns."""
    a, b = fleet
    a.refuse["v1"] = 422
    b.gates["v1"] = asyncio.Event()
    cfg = ProxyConfig(upstreams=(a.url, b.url), port=0, broadcast_timeout_s=0.5, **FAST)
    async with serve_proxy(cfg) as base, aiohttp.ClientSession() as session:
        c = Client(session, base)
        assert (await c.load("v1"))[0] == 422
        b.gates["v1"].set()
        for _ in range(100):  # the load lands on b after all
            if "v1" in b.adapters:
                break
            await asyncio.sleep(0.05)
        await c.wait_circuit(b.url, "half_open", "closed")
        assert a.adapters == b.adapters == set()


async def test_a_joiner_added_at_run_time_catches_up_then_serves(fleet: list[StandIn]) -> None:
    a, b = fleet
    cfg = ProxyConfig(
        upstreams=(a.url,), port=0, routing="round_robin", admin_api_key=ADMIN, **FAST
    )
    async with serve_proxy(cfg) as base, aiohttp.ClientSession() as session:
        c = Client(session, base)
        assert (await c.load("v1"))[0] == 200
        assert (await c.post("/pause?mode=keep"))[0] == 200
        status, text = await c.post("/proxy/upstreams", {"url": b.url}, key=ADMIN)
        assert status == 200, text
        assert b.adapters == {"v1"} and b.paused  # as the fleet is
        assert (await c.post("/resume"))[0] == 200 and not b.paused
        async with session.post(base + "/v1/completions", json={"model": "v1"}) as r:
            first = r.headers[REPLICA_HEADER]
        async with session.post(base + "/v1/completions", json={"model": "v1"}) as r:
            assert {first, r.headers[REPLICA_HEADER]} == {a.url, b.url}
        _, stats = await c.get("/proxy/stats")
        assert stats["fleet"]["joins_total"] == 1  # type: ignore[index]


async def test_health_answers_for_the_fleet_down_to_a_minimum(fleet: list[StandIn]) -> None:
    a, b = fleet
    for need, alive, want in ((1, 2, 200), (1, 1, 200), (2, 1, 503), (1, 0, 503)):
        cfg = ProxyConfig(upstreams=(a.url, b.url), port=0, min_healthy_replicas=need, **FAST)
        for r, up in zip(fleet, (alive >= 1, alive >= 2), strict=True):
            if up and r.runner is None:
                await r.start()
            elif not up and r.runner is not None:
                await r.stop()
        async with serve_proxy(cfg) as base, aiohttp.ClientSession() as session:
            status, doc = await Client(session, base).get("/health")
        assert (status, doc["serving"]) == (want, alive), doc  # type: ignore[index]
        assert doc["min_healthy_replicas"] == need  # type: ignore[index]


async def test_a_proxy_in_front_keeps_a_proxy_whose_fleet_lost_a_member(
    fleet: list[StandIn],
) -> None:
    """A proxy (a trainer's, a load balancer) in front of a standalone proxy health-checks it:
    one dead replica behind it must not take the whole fleet out of rotation."""
    a, b = fleet
    inner_cfg = ProxyConfig(upstreams=(a.url, b.url), port=0, routing="round_robin", **FAST)
    async with serve_proxy(inner_cfg) as inner:
        outer_cfg = ProxyConfig(upstreams=(inner,), port=0, **FAST)
        async with serve_proxy(outer_cfg) as base, aiohttp.ClientSession() as session:
            c = Client(session, base)
            assert (await c.load("v1"))[0] == 200
            await b.stop()
            await asyncio.sleep(1.0)  # ten health rounds of both proxies
            assert (await c.upstream(inner))["circuit"] == "closed"
            assert (await c.post("/pause?mode=keep"))[0] == 200
            assert (await c.load("v2"))[0] == 200
            assert (await c.post("/resume"))[0] == 200
            answers = [await c.post("/v1/completions", {"model": "v2"}) for _ in range(4)]
            assert [s for s, _ in answers] == [200] * 4 and a.served == 4


def stand_in_adapter(tmp_path: Path) -> Path:
    """An adapter directory the stand-in replicas accept (they read no weights)."""
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"r": 1, "lora_alpha": 2}')
    (adapter / "adapter_model.safetensors").write_bytes(b"weights")
    return adapter


def one_attempt_sync(store: AdapterStore, client: VLLMClient, cache: Path) -> AdapterSync:
    """The trainer's sync of run ``run-x`` at ``max_staleness`` 0, loading by path, one try."""
    return AdapterSync(
        store=store,
        source=LocalCacheSource(store, cache),
        loader=ProxyLoader(client),
        prefix="run-x",
        max_staleness=0,
        attempts=1,
    )


@pytest.mark.parametrize("when", ["before", "after"])
async def test_the_trainers_sync_goes_through_when_a_replica_dies_in_the_middle_of_it(
    fleet: list[StandIn], tmp_path: Path, when: str
) -> None:
    """The trainer's sequence (publish, load while serving, switch, retire) with one attempt
    only: a replica whose engine dies at the load, before or after answering it, does not fail
    it."""
    a, b = fleet
    b.die_on_load = {"run-x-v1": when}
    cfg = ProxyConfig(
        upstreams=(a.url, b.url),
        port=0,
        lora_roots=(str(tmp_path),),
        **{**FAST, "health_interval_s": 3600},
    )
    store, adapter = AdapterStore(str(tmp_path / "store")), stand_in_adapter(tmp_path)
    async with serve_proxy(cfg) as base, VLLMClient(base) as client:
        sync = one_attempt_sync(store, client, tmp_path / "cache")
        switched: list[str] = []

        async def on_loaded(name: str, version: int) -> None:
            switched.append(name)

        await sync.sync(0, adapter, step=0, on_loaded=on_loaded)
        await sync.sync(1, adapter, step=1, on_loaded=on_loaded)
    assert switched == ["run-x-v0", "run-x-v1"]
    assert a.adapters == {"run-x-v1"} and not a.paused and b.dead
    assert b.adapters == ({"run-x-v0"} if when == "before" else {"run-x-v0", "run-x-v1"})


async def test_an_unload_one_replica_failed_is_tried_again_at_the_next_retire(
    fleet: list[StandIn], tmp_path: Path
) -> None:
    """A replica that stays in rotation but fails an unload would serve (and cache) that version
    until it restarts: the proxy replays no unload to it. The trainer's sync tries again."""
    a, b = fleet
    b.fail_unload = {"run-x-v0": 1}
    cfg = ProxyConfig(
        upstreams=(a.url, b.url),
        port=0,
        lora_roots=(str(tmp_path),),
        **{**FAST, "health_interval_s": 3600},
    )
    store, adapter = AdapterStore(str(tmp_path / "store")), stand_in_adapter(tmp_path)
    async with serve_proxy(cfg) as base, VLLMClient(base) as client:
        sync = one_attempt_sync(store, client, tmp_path / "cache")
        await sync.sync(0, adapter, step=0)
        await sync.sync(1, adapter, step=1)  # retiring v0 fails on b
        assert a.adapters == {"run-x-v1"} and b.adapters == {"run-x-v0", "run-x-v1"}
        cached = lambda: sorted(p.name for p in (tmp_path / "cache").iterdir())  # noqa: E731
        assert cached() == ["run-x-v0", "run-x-v1"]  # b may still read v0's files
        await sync.sync(2, adapter, step=2)
        assert a.adapters == b.adapters == {"run-x-v2"}
        assert cached() == ["run-x-v2"]  # the cache holds the window, not the run's history
        await sync.unload_all()
    assert a.adapters == b.adapters == set()
    assert cached() == []


async def test_a_pinned_version_stays_loaded_past_the_window_until_unpinned(
    fleet: list[StandIn], tmp_path: Path
) -> None:
    """An evaluation pins the version it runs on: the trainer's retire passes over it, and
    the unpin unloads it once it has left the window (and not a version still in it)."""
    a, b = fleet
    cfg = ProxyConfig(
        upstreams=(a.url, b.url),
        port=0,
        lora_roots=(str(tmp_path),),
        **{**FAST, "health_interval_s": 3600},
    )
    store, adapter = AdapterStore(str(tmp_path / "store")), stand_in_adapter(tmp_path)
    async with serve_proxy(cfg) as base, VLLMClient(base) as client:
        sync = one_attempt_sync(store, client, tmp_path / "cache")
        await sync.sync(0, adapter, step=0)
        assert sync.pin(0) == "run-x-v0" and sync.pinned() == [0]
        await sync.sync(1, adapter, step=1)
        await sync.sync(2, adapter, step=2)
        assert a.adapters == b.adapters == {"run-x-v0", "run-x-v2"}
        await sync.unpin(0)
        assert a.adapters == b.adapters == {"run-x-v2"} and sync.pinned() == []
        sync.pin(2)
        await sync.unpin(2)  # still the newest: it stays
        assert a.adapters == b.adapters == {"run-x-v2"}
        await sync.unload_all()


async def test_a_request_naming_its_run_counts_for_that_run(fleet: list[StandIn]) -> None:
    """``X-Asyncgrpo-Run``: an evaluation generates under a training run's adapter name but
    is a run of its own in the proxy's book (its own share weight); a bad name is a 400."""
    cfg = ProxyConfig(upstreams=tuple(r.url for r in fleet), port=0, **FAST)
    async with serve_proxy(cfg) as base, aiohttp.ClientSession() as session:
        assert (await Client(session, base).load("run-x-v3"))[0] == 200
        body = {"model": "run-x-v3", "prompt": "hi"}
        for headers in ({}, {"X-Asyncgrpo-Run": "run-x-eval"}, {"X-Asyncgrpo-Run": "run-x-eval"}):
            async with session.post(base + "/v1/completions", json=body, headers=headers) as r:
                assert r.status == 200
        async with session.post(
            base + "/v1/completions", json=body, headers={"X-Asyncgrpo-Run": "a b"}
        ) as r:
            assert r.status == 400 and "X-Asyncgrpo-Run" in await r.text()
        _, doc = await Client(session, base).get("/proxy/runs")
    runs = doc["runs"]  # type: ignore[index]
    assert runs["run-x"]["requests"] == 1 and runs["run-x-eval"]["requests"] == 2


async def test_a_restarted_trainer_keeps_its_predecessors_fresh_versions_loaded(
    fleet: list[StandIn], tmp_path: Path
) -> None:
    """A trainer killed after version 5 (max_staleness 2: versions 3-5 loaded) and started
    again: before it publishes version 6 it unloads what falls outside 6's window (3) and keeps
    4 and 5, which rollout processes request until they read the new policy (unloading them at
    once answered their requests 404 and ended them), retiring each as it ages out."""
    cfg = ProxyConfig(
        upstreams=tuple(r.url for r in fleet), port=0, lora_roots=(str(tmp_path),), **FAST
    )
    store, adapter = AdapterStore(str(tmp_path / "store")), stand_in_adapter(tmp_path)
    names = {f"run-x-v{v}" for v in range(8)}

    def loaded() -> set[str]:
        assert fleet[0].adapters == fleet[1].adapters
        return fleet[0].adapters & names

    async with serve_proxy(cfg) as base, VLLMClient(base) as client:

        def new_sync() -> AdapterSync:
            return AdapterSync(
                store=store,
                source=LocalCacheSource(store, tmp_path / "cache"),
                loader=ProxyLoader(client),
                prefix="run-x",
                max_staleness=2,
            )

        killed = new_sync()
        for v in range(6):
            await killed.sync(v, adapter, step=v)
        assert loaded() == {"run-x-v3", "run-x-v4", "run-x-v5"}
        restarted = new_sync()  # the next process: it knows of nothing loaded
        assert await restarted.retire_leftovers(6) == ["run-x-v3"]
        assert loaded() == {"run-x-v4", "run-x-v5"}
        await restarted.sync(6, adapter, step=6)
        assert loaded() == {"run-x-v4", "run-x-v5", "run-x-v6"}
        await restarted.sync(7, adapter, step=7)
        assert loaded() == {"run-x-v5", "run-x-v6", "run-x-v7"}
        await restarted.unload_all()
        assert loaded() == set()


async def test_a_plugin_load_the_replicas_already_serve_succeeds_and_is_remembered(
    fleet: list[StandIn],
) -> None:
    """The trainer's load sent again after the proxy that sent it first was killed with the
    answer in flight (the fault schedule's proxy kill; before, the new proxy answered the
    replicas' 400 "already loaded" and the trainer stopped): a plugin load's name is the version
    its URI names, so the replicas serve these weights already. The load succeeds, nothing is
    rolled back, and the new proxy replays it to a replica that restarts."""
    a, b = fleet
    name = "run-1a2b-v3"
    a.adapters.add(name)  # loaded on both through the proxy that died
    b.adapters.add(name)
    cfg = ProxyConfig(upstreams=(a.url, b.url), port=0, **FAST)
    async with serve_proxy(cfg) as base, aiohttp.ClientSession() as session:
        c = Client(session, base)
        body = {"lora_name": name, "lora_uri": "s3://bucket/run/adapters/run-1a2b/v3"}
        status, text = await c.post("/v1/asyncgrpo/load", body)
        assert status == 200, text
        assert a.adapters == b.adapters == {name}
        _, stats = await c.get("/proxy/stats")
        assert name in stats["adapters"]  # type: ignore[index]
        await b.stop()
        await c.wait_circuit(b.url, "open")
        await b.start()  # restarted: nothing loaded, brought up to date when it returns
        await c.wait_circuit(b.url, "half_open", "closed")
        assert b.adapters == {name}
