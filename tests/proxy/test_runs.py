"""Runs sharing the replicas (asyncgrpo.proxy.runs): pure books, then the proxy's routes over
sockets in front of stand-in replicas that hold requests until told."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from asyncgrpo.errors import ConfigError
from asyncgrpo.proxy import ProxyConfig, serve_proxy
from asyncgrpo.proxy.admin_client import ProxyClient
from asyncgrpo.proxy.runs import OVERFLOW, Run, Runs, run_of, sequences
from asyncgrpo.testing.vllm_metrics import samples


class Req:
    """A request waiting for its turn; ``admitted`` records the order turns came in."""

    def __init__(self, name: str, order: list[str], on_admit=None) -> None:
        self.name, self.order, self.on_admit = name, order, on_admit

    def admitted(self) -> None:
        self.order.append(self.name)
        if self.on_admit is not None:
            self.on_admit(self)


def test_a_requests_run_is_its_model_less_the_version() -> None:
    assert run_of("tiny-1a2b3c4d-v12") == "tiny-1a2b3c4d"
    assert run_of("tiny-v2-v0") == "tiny-v2"
    assert run_of("Qwen/Qwen2.5-1.5B") == "Qwen/Qwen2.5-1.5B"
    assert run_of("x-v") == "x-v" and run_of("-v3") == "-v3"
    assert sequences({"prompt": [1, 2, 3]}) == 1 and sequences({"prompt": "a", "n": 8}) == 8
    assert sequences({"prompt": [[1, 2], [3]], "n": 2}) == 4
    assert sequences({"prompt": ["a", "b", "c"]}) == 3 and sequences({"messages": []}) == 1
    assert sequences({"prompt": "a", "n": "8"}) == 1 and sequences({"n": True}) == 1


def _saturate(runs: Runs, demand: dict[str, int], order: list[str]) -> dict[str, list[Req]]:
    """Each run sends ``demand`` requests of one sequence; returns those sent at once."""
    sent: dict[str, list[Req]] = {}
    for name, n in demand.items():
        run = runs.run(f"{name}-v0", 0.0)
        for _ in range(n):
            req = Req(name, order)
            if runs.admit(run, req, 1, 0.0):
                sent.setdefault(name, []).append(req)
    return sent


def test_beyond_capacity_each_freed_place_goes_to_the_run_furthest_below_its_share() -> None:
    runs = Runs(lease_s=60)
    runs.per_replica = 4
    runs.resize(2, 0.0)  # 8 sequences
    order: list[str] = []
    sent = _saturate(runs, {"a": 20, "b": 6}, order)
    assert len(sent["a"]) == 8 and "b" not in sent  # a came first and found room
    assert runs.waiting == 12 + 6 and runs.runs["b"].requests == 6
    a, b = runs.runs["a"], runs.runs["b"]
    # a's requests end one by one: b (0 in flight) gets every place until it has as many as a
    for _ in range(4):
        runs.done(a, 1, 1.0)
        runs.pump(1.0)
    assert order == ["b"] * 4 and (a.inflight, b.inflight) == (4, 4)
    runs.done(a, 1, 1.0)
    runs.pump(1.0)
    runs.done(b, 1, 1.0)
    runs.pump(1.0)
    assert order[4:] == ["a", "b"]  # at equal shares a freed place goes back to its run
    assert (a.inflight, b.inflight) == (4, 4) and len(b.queue) == 1
    assert a.waited_s == pytest.approx(1.0) and b.sequence_s == pytest.approx(1.0)


def test_weights_set_the_shares_and_a_run_asking_less_gets_all_it_asks() -> None:
    runs = Runs(lease_s=60)
    runs.per_replica = 8
    runs.resize(1, 0.0)
    order: list[str] = []
    runs.run("a-v0", 0.0).weight = 3.0
    _saturate(runs, {"a": 100, "b": 100, "c": 1}, order)
    runs.runs["a"].inflight = runs.inflight = 0  # the first 8 were a's: let them all end
    for _ in range(8):
        runs.pump(0.0)  # one place at a time: what a freed request does
    a, b, c = (runs.runs[n] for n in "abc")
    # c gets all it asked; a and b split the rest 3:1
    assert (a.inflight, b.inflight, c.inflight) == (5, 2, 1)
    assert order.count("c") == 1


def _one_place() -> tuple[Runs, Run, list[str]]:
    """Room for one sequence; run ``a``; the order turns come in."""
    runs = Runs(lease_s=60)
    runs.per_replica = 1
    runs.resize(1, 0.0)
    return runs, runs.run("a-v0", 0.0), []


def test_a_request_that_ends_at_once_frees_its_place_without_recursion() -> None:
    runs, run, order = _one_place()

    def fail_at_once(req: Req) -> None:  # no replica: answered 503 inside its own start
        runs.done(run, 1, 0.0)
        runs.pump(0.0)

    held = Req("first", order)
    assert runs.admit(run, held, 1, 0.0)
    for i in range(3000):  # deeper than Python's recursion limit, were it nested
        assert not runs.admit(run, Req(str(i), order, fail_at_once), 1, 0.0)
    runs.done(run, 1, 0.0)
    runs.pump(0.0)
    assert len(order) == 3000 and runs.waiting == 0 and runs.inflight == 0


def test_a_waiting_request_withdrawn_and_no_replica_means_no_waiting() -> None:
    runs, run, order = _one_place()
    first, second, third = Req("1", order), Req("2", order), Req("3", order)
    assert runs.admit(run, first, 1, 0.0)
    assert not runs.admit(run, second, 1, 0.0) and not runs.admit(run, third, 1, 0.0)
    runs.withdraw(run, second)
    assert runs.waiting == 1
    runs.resize(0, 0.0)  # the last replica left: nothing waits (they fail as they would)
    assert runs.capacity is None and order == ["3"] and runs.waiting == 0
    assert runs.admit(run, Req("4", order), 1, 0.0)


def test_lora_slots_are_booked_per_run_and_a_run_that_does_not_fit_is_refused() -> None:
    runs = Runs(lease_s=100)
    book = {"max_loras": 6, "loaded": (), "now": 0.0}
    assert runs.register("a-1", slots=2, weight=1.0, **book) is None
    assert runs.register("b-2", slots=2, weight=2.0, **book) is None
    why = runs.register("c-3", slots=3, weight=1.0, **book)
    assert why is not None and "--max-loras 6" in why and "4 of them taken" in why
    assert "a-1 2, b-2 2" in why and "--max-loras 7" in why and "c-3" not in runs.runs
    assert runs.register("a-1", slots=2, weight=1.0, **book) is None  # a restart: its own slots
    assert runs.release("b-2") and not runs.release("b-2") and not runs.release("nobody")
    assert runs.register("c-3", slots=3, weight=1.0, **book) is None
    # adapters loaded by a client that never registered hold one slot each
    why = runs.register("d-4", slots=1, weight=1.0, max_loras=6, loaded=("e-v0",), now=0.0)
    assert why is not None and "e 1" in why
    assert runs.holders(["a-1-v3", "e-v0", "e-v1"]) == {"a-1": 2, "c-3": 3, "e": 2}
    # a run silent for lease_s loses its registration; one with requests in flight does not
    runs.run("c-3-v0", 50.0).inflight = 1
    assert runs.expire(150.0) == ["a-1"] and runs.runs["c-3"].slots == 3


def test_the_table_of_runs_is_bounded() -> None:
    runs = Runs(lease_s=60, max_runs=3)
    assert runs.register("kept", slots=1, weight=1.0, max_loras=9, loaded=(), now=0.0) is None
    busy = runs.run("busy-v0", 0.0)
    busy.inflight = 1
    runs.run("idle-v0", 0.0)
    assert runs.run("new-v0", 1.0).name == "new"  # the idle one made room
    assert set(runs.runs) == {"kept", "busy", "new"}
    runs.runs["new"].inflight = 1
    assert runs.run("more-v0", 2.0).name == OVERFLOW
    assert isinstance(runs.runs[OVERFLOW], Run)


pytestmark = pytest.mark.anyio
INFO = {
    "vllm_config": {
        "cache_config": {"block_size": 16},
        "lora_config": {"max_loras": 4},
        "scheduler_config": {"max_num_seqs": 2},
    }
}


@pytest.fixture
async def replica() -> AsyncIterator[tuple[str, dict]]:
    """A stand-in replica that runs 2 sequences at once (its /server_info says so) and holds
    each completion until the test releases one."""
    state: dict = {"arrived": [], "gate": asyncio.Semaphore(0)}

    async def completions(request: web.Request) -> web.Response:
        model = (await request.json())["model"]
        state["arrived"].append(model)
        await state["gate"].acquire()
        return web.json_response({"model": model})

    async def server_info(request: web.Request) -> web.Response:
        return web.json_response(INFO)

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="")

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/server_info", server_info)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", state
    finally:
        await runner.cleanup()


async def _until(predicate, timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out")


async def test_saturated_replicas_serve_the_runs_in_turns_and_count_them(replica) -> None:
    """At the replica's --max-num-seqs the proxy holds requests back and gives each freed
    place to the run with fewer in flight: b's requests, sent after a's, go out between them
    (first come first served would send all of a's first). A waiting client that leaves is
    dropped without reaching the replica. Per-run figures in /proxy/stats and /metrics."""
    url, state = replica
    async with serve_proxy(ProxyConfig(upstreams=(url,), port=0)) as base:
        async with aiohttp.ClientSession() as http:

            async def complete(model: str) -> None:
                body = {"model": model, "prompt": [1, 2, 3]}
                async with http.post(f"{base}/v1/completions", json=body) as resp:
                    assert resp.status == 200

            sent = [asyncio.create_task(complete("a-1-v0")) for _ in range(4)]
            await _until(lambda: len(state["arrived"]) == 2)
            sent += [asyncio.create_task(complete("b-2-v3")) for _ in range(2)]
            await asyncio.sleep(0.2)
            async with http.get(f"{base}/proxy/stats") as resp:
                stats = await resp.json()
            assert stats["share"] == {"capacity": 2, "inflight": 2, "waiting": 4}
            gone = asyncio.create_task(complete("c-3-v0"))
            await asyncio.sleep(0.2)
            gone.cancel()  # its client leaves while it waits: dropped once the proxy sees it
            await asyncio.gather(gone, return_exceptions=True)
            for _ in range(50):
                async with http.get(f"{base}/proxy/stats") as resp:
                    if (await resp.json())["share"]["waiting"] == 4:
                        break
                await asyncio.sleep(0.05)
            for n in range(3, 7):
                state["gate"].release()
                await _until(lambda n=n: len(state["arrived"]) == n)
            for _ in range(2):
                state["gate"].release()
            await asyncio.gather(*sent)
            assert state["arrived"] == ["a-1-v0"] * 2 + ["b-2-v3", "a-1-v0", "b-2-v3", "a-1-v0"]
            async with http.get(f"{base}/proxy/stats") as resp:
                stats = await resp.json()
            async with http.get(f"{base}/metrics") as resp:
                metrics = await resp.text()
    a, b = stats["runs"]["a-1"], stats["runs"]["b-2"]
    assert (a["requests"], b["requests"], a["inflight"], b["queued"]) == (4, 2, 0, 0)
    assert stats["runs"]["c-3"]["requests"] == 1 and stats["share"]["waiting"] == 0
    assert b["waited_s"] > 0 and a["sequence_s"] > 0
    m = samples(metrics)
    assert m['asyncgrpo_proxy_run_requests_total{run="a-1"}'] == 4
    assert m['asyncgrpo_proxy_run_waiting{run="c-3"}'] == 0
    assert m["asyncgrpo_proxy_share_capacity"] == 2


async def test_runs_register_their_lora_slots_and_one_that_does_not_fit_is_refused(
    replica,
) -> None:
    url, _ = replica
    async with serve_proxy(ProxyConfig(upstreams=(url,), port=0)) as base:
        async with aiohttp.ClientSession() as http:

            async def call(method: str, body: object) -> tuple[int, dict]:
                async with http.request(method, f"{base}/proxy/runs", json=body) as resp:
                    return resp.status, await resp.json()

            assert (await call("POST", {"run": "a-1", "lora_slots": 2}))[0] == 200
            status, doc = await call("POST", {"run": "b-2", "lora_slots": 2, "weight": 2})
            assert status == 200 and doc["max_loras"] == 4
            assert doc["lora_slots_held"] == {"a-1": 2, "b-2": 2}
            token = doc["token"]
            status, doc = await call("POST", {"run": "c-3", "lora_slots": 1})
            assert status == 409
            message = doc["error"]["message"]
            assert "--max-loras 4" in message and "needs 1 LoRA slots" in message, message
            assert "--max-loras 5" in message  # what to restart them with
            # only the holder of b-2's token may release or re-register it
            assert (await call("DELETE", {"run": "b-2"}))[0] == 403
            assert (await call("DELETE", {"run": "b-2", "token": "x" * 32}))[0] == 403
            status, doc = await call("POST", {"run": "b-2", "lora_slots": 1, "weight": 1e-3})
            assert status == 403 and "another holder" in doc["error"]["message"]
            assert (await call("DELETE", {"run": "b-2", "token": token}))[0] == 200
            assert (await call("DELETE", {"run": "b-2", "token": token}))[0] == 404
            assert (await call("POST", {"run": "c-3", "lora_slots": 1}))[0] == 200
            for bad in (
                {"lora_slots": 1},
                {"run": "x", "lora_slots": 0},
                {"run": "x", "lora_slots": 1, "weight": -1},
                {"run": "x", "lora_slots": 1, "weight": 5e-324},
                {"run": "x", "lora_slots": 1, "weight": 1e300},
                {"run": "x" * 257, "lora_slots": 1},
                {"run": "a b", "lora_slots": 1},
                {"run": "x", "lora_slots": 1, "token": "short"},
                ["x"],
            ):
                status, doc = await call("POST", bad)
                assert status == 400, (bad, doc)
            status, doc = await call("GET", None)
    assert status == 200
    # a released run holds no slots but its counters stay readable
    assert {n: r["lora_slots"] for n, r in doc["runs"].items()} == {"a-1": 2, "b-2": None, "c-3": 1}
    assert "token" not in str(doc)


async def test_a_run_books_its_slots_through_the_client_and_a_plain_server_keeps_no_book(
    replica,
) -> None:
    """What a run does at start (asyncgrpo.run.training): the refusal is a ConfigError carrying the
    proxy's message; a vLLM server (no /proxy/runs) is no error, there is just no booking."""
    url, _ = replica
    async with serve_proxy(ProxyConfig(upstreams=(url,), port=0)) as base:
        async with ProxyClient(base) as client:
            token = "t" * 32
            assert await client.register_run("a-1", lora_slots=3, token=token)
            assert await client.register_run("a-1", lora_slots=3, token=token)  # restarted
            with pytest.raises(ConfigError, match=r"run b-2 needs 2 LoRA slots.*--max-loras 4"):
                await client.register_run("b-2", lora_slots=2, weight=0.5)
            with pytest.raises(ConfigError, match="another holder"):
                await client.register_run("a-1", lora_slots=1, token="u" * 32)
            await client.release_run("a-1", token=token)
            await client.release_run("a-1", token=token)  # gone already: nothing to give back
            assert await client.register_run("b-2", lora_slots=2, weight=0.5)
    async with ProxyClient(url) as client:
        assert not await client.register_run("a-1", lora_slots=3)
    admin = ProxyConfig(upstreams=(url,), port=0, admin_api_key="k" * 32)
    async with serve_proxy(admin) as base, ProxyClient(base) as client:
        with pytest.raises(ConfigError, match=r"behind its admin key.*proxy\.admin_api_key"):
            await client.register_run("a-1", lora_slots=3, token="t" * 32)


def test_register_release_churn_keeps_the_table_within_max_runs() -> None:
    """3,000 register/release pairs left 3,003 entries with max_runs 1,024: a registration past
    max_runs takes the place of an idle unregistered run (a released one) or is refused;
    requests of runs beyond it count under OVERFLOW."""
    runs = Runs(lease_s=60, max_runs=8)
    for i in range(3000):
        assert runs.register(f"r{i}", slots=1, weight=1.0, max_loras=4, loaded=(), now=i) is None
        assert runs.release(f"r{i}")
    assert len(runs.runs) <= 8
    for i in range(8):
        runs.run(f"busy{i}-v0", 0.0).inflight = 1
    why = runs.register("late", slots=1, weight=1.0, max_loras=4, loaded=(), now=1.0)
    assert why is not None and "max_runs=8" in why
    assert runs.run("more-v0", 1.0).name == OVERFLOW and runs.folded == 1
    assert len(runs.runs) == 9  # OVERFLOW's own entry


def test_waiting_requests_have_a_deadline_a_cap_and_the_heaviest_run_is_evicted_first() -> None:
    class Held(Req):
        def dropped(self, status: int, message: str, *, close: bool) -> None:
            self.order.append(f"{self.name}:{status}:{close}")

    runs = Runs(lease_s=60, max_queued=3, queue_timeout_s=10.0)
    runs.per_replica = 1
    runs.resize(1, 0.0)
    order: list[str] = []
    a, b = runs.run("a-v0", 0.0), runs.run("b-v0", 0.0)
    assert runs.admit(a, Held("a0", order), 1, 0.0)
    for i in range(3):
        assert not runs.queue_full(a)
        assert not runs.admit(a, Held(f"a{i + 1}", order), 1, float(i))
    assert runs.queue_full(a) and not runs.queue_full(b)
    assert not runs.admit(b, Held("b1", order), 1, 5.0)
    assert runs.evict(2, 6.0) == 2  # a holds the most waiting: its two oldest
    assert order == ["a1:503:True", "a2:503:True"]
    runs.expire_waiting(12.5)  # a3 waited since 2.0: over 10 s; b1 since 5.0 not yet
    assert order[2:] == ["a3:503:False"] and runs.waiting == 1
    runs.expire_waiting(15.5)
    assert order[3:] == ["b1:503:False"] and runs.waiting == 0


async def _open(
    base: str, model: str, pad: int = 0
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection that has sent one completion request for ``model``."""
    host, port = base.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    body = json.dumps({"model": model, "prompt": "x" * pad}).encode()
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Length: %d\r\n\r\n%s"
        % (host.encode(), len(body), body)
    )
    return reader, writer


async def _status(reader: asyncio.StreamReader, timeout_s: float = 10.0) -> int:
    """The status of the next answer on a connection (0: closed without one)."""
    try:
        line = await asyncio.wait_for(reader.readline(), timeout_s)
    except (ConnectionError, TimeoutError):
        return 0
    return int(line.split()[1]) if line else 0


async def test_one_client_cannot_lock_the_others_out_at_the_connection_cap(replica) -> None:
    """A client holding more queued requests than the connection cap: each new connection
    makes room by evicting the longest-waiting queued requests of the run with the most (503,
    closed), so another client still gets in and is served in its turn (before: 503 too many
    connections)."""
    url, state = replica
    cfg = ProxyConfig(upstreams=(url,), port=0, max_connections=16)
    async with serve_proxy(cfg) as base:
        flood = [await _open(base, "evil-v0") for _ in range(24)]
        await _until(lambda: len(state["arrived"]) == 2)
        await asyncio.sleep(0.2)
        victim = await _open(base, "good-v0")
        await asyncio.sleep(0.2)
        state["gate"].release()  # a place frees: the victim's run is furthest below its share
        await _until(lambda: "good-v0" in state["arrived"])
        for _ in range(30):
            state["gate"].release()
        assert await _status(victim[0]) == 200
        statuses = [await _status(r, 2.0) for r, _ in flood]
        for _, w in [*flood, victim]:
            w.close()
    assert statuses.count(503) >= 24 - 16  # evicted (or refused) to make room
    assert 200 in statuses


async def test_a_waiting_request_has_a_deadline_and_a_run_a_cap_on_its_queue(replica) -> None:
    url, state = replica
    cfg = ProxyConfig(upstreams=(url,), port=0, queue_timeout_s=0.3, max_queued_per_run=1)
    async with serve_proxy(cfg) as base:
        held = [await _open(base, "a-v0") for _ in range(2)]
        await _until(lambda: len(state["arrived"]) == 2)
        waiting = await _open(base, "a-v0")
        await asyncio.sleep(0.1)
        over = await _open(base, "a-v0")
        assert await _status(over[0], 2.0) == 429  # a's queue holds one already
        t0 = asyncio.get_running_loop().time()
        assert await _status(waiting[0], 5.0) == 503  # waited over queue_timeout_s
        assert asyncio.get_running_loop().time() - t0 < 2.0
        for _ in range(2):
            state["gate"].release()
        assert [await _status(r) for r, _ in held] == [200, 200]
        for _, w in [*held, waiting, over]:
            w.close()


async def test_the_bodies_held_at_once_are_bounded(replica) -> None:
    url, state = replica
    cfg = ProxyConfig(upstreams=(url,), port=0, max_body_bytes=4096, max_buffered_bytes=8192)
    async with serve_proxy(cfg) as base:
        held = [await _open(base, "a-v0", pad=3000) for _ in range(2)]
        await _until(lambda: len(state["arrived"]) == 2)
        over = await _open(base, "b-v0", pad=3000)
        assert await _status(over[0], 5.0) == 503
        for _ in range(2):
            state["gate"].release()
        assert [await _status(r) for r, _ in held] == [200, 200]
        again = await _open(base, "b-v0", pad=3000)  # released: room again
        state["gate"].release()
        assert await _status(again[0]) == 200
        for _, w in [*held, over, again]:
            w.close()
