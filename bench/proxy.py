"""Proxy benchmark, side by side in one run.

(a) Routing quality on real vLLM CPU replicas under a GRPO-shaped load (G rollouts per prompt,
    one shared chat-template prefix, 128-256 own prompt tokens, many in flight): every routing
    policy the proxy has, round-robin (the baseline) first. Reports affinity / unmatched /
    spilled, the replicas' own prefix-cache hit rate (vllm:prefix_cache_hits_total /
    queries_total deltas) and wall time.
(b) Overhead against a canned local upstream (an aiohttp app returning a fixed completion):
    requests/s and p50/p99 latency direct vs through the proxy, 1 and 256 in flight. A third path,
    a zero-work TCP relay (asyncio protocol, bytes in -> bytes out, no parsing), shows what any
    extra local hop costs on this machine: the floor under the proxy's added latency.
(c) llhttp's share: microseconds for httptools to parse the request of (b) and the canned answer,
    with the callbacks the proxy registers (one Python call per header) and with none but
    on_message_complete.

    python bench/proxy.py                      # both parts; starts 2 vLLM replicas of a tiny model
    python bench/proxy.py --part overhead      # (b) only, ~1 min
    python bench/proxy.py --part parse         # (c) only, seconds
    python bench/proxy.py --upstream URL --upstream URL --part routing   # reuse running replicas
    python bench/proxy.py --part overhead --baseline ../main   # A/B: that checkout's proxy too
    python bench/proxy.py --part overhead --baseline /tmp/old --baseline ../main   # A/B/C
    python bench/proxy.py --part hostile --baseline ../main    # (d) and (e), A/B, ~2 min

(d) Stall: while one 32 MiB body (one-token prompts, or a chat of many messages) goes through
    the proxy, the latency of small requests sent one at a time by another client (p50, p99, max).
(e) Floods: the proxy's resident memory after 48 MB of trailers on one chunked request and after
    300 requests whose model names are 64 KB each, and the size of /metrics then; its peak
    memory and the slowest /health while one 8 MB body comes in 1-byte chunks (48 MB on the
    wire).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from asyncgrpo.config.proxy import ROUTING_POLICIES
from asyncgrpo.proxy.router import make_policy
from asyncgrpo.testing.vllm_metrics import prefix_cache

# -- defaults -----------------------------------------------------------------------------------
PROMPTS = 64
G = 8
INFLIGHT = 64
TEMPLATE_TOKENS = 151
MAX_TOKENS = 16
OVERHEAD_REQUESTS_1 = 4000  # per path, sent in blocks that rotate over the paths
OVERHEAD_BLOCK_1 = 50
OVERHEAD_REQUESTS_256 = 2000  # per round: short rounds interleave the paths finely
OVERHEAD_ROUNDS = 16
PY = sys.executable

CANNED = json.dumps(
    {
        "id": "cmpl-bench",
        "object": "text_completion",
        "created": 0,
        "model": "bench",
        "choices": [
            {
                "index": 0,
                "text": " 42",
                "logprobs": None,
                "finish_reason": "length",
                "token_ids": [52, 50],
            }
        ],
        "usage": {"prompt_tokens": 300, "completion_tokens": 2, "total_tokens": 302},
    }
).encode()


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def wait_http(url: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with s.get(url) as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


@contextlib.contextmanager
def subprocess_server(argv: list[str], env: dict | None = None, cwd: str | None = None):
    proc = subprocess.Popen(
        argv, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        yield proc
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# -- (b) overhead -------------------------------------------------------------------------------


def run_canned_upstream(port: int) -> None:
    """The fast local upstream: fixed answers, no work."""
    from aiohttp import web

    async def completions(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=CANNED, content_type="application/json")

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="")

    async def server_info(request: web.Request) -> web.Response:
        return web.json_response({"vllm_config": {"cache_config": {"block_size": 16}}})

    app = web.Application(client_max_size=64 * 1024 * 1024)  # part (d)'s 32 MiB bodies
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health)
    app.router.add_get("/server_info", server_info)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


def run_relay(port: int, upstream_port: int) -> None:
    """The floor: one upstream connection per client connection, bytes copied both ways."""

    class Back(asyncio.Protocol):
        def __init__(self, front: asyncio.Transport) -> None:
            self.front = front

        def data_received(self, data: bytes) -> None:
            self.front.write(data)

        def connection_lost(self, exc: Exception | None) -> None:
            self.front.close()

    class Front(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport = transport
            self.back: asyncio.Transport | None = None
            self.early: list[bytes] = []
            self.connecting = asyncio.ensure_future(self.connect())

        async def connect(self) -> None:
            loop = asyncio.get_running_loop()
            back, _ = await loop.create_connection(
                lambda: Back(self.transport), "127.0.0.1", upstream_port
            )
            self.back = back
            for data in self.early:
                back.write(data)

        def data_received(self, data: bytes) -> None:
            if self.back is None:
                self.early.append(data)
            else:
                self.back.write(data)

        def connection_lost(self, exc: Exception | None) -> None:
            if self.back is not None:
                self.back.close()

    async def serve() -> None:
        server = await asyncio.get_running_loop().create_server(Front, "127.0.0.1", port)
        await server.serve_forever()

    try:
        import uvloop

        uvloop.run(serve())
    except ImportError:
        asyncio.run(serve())


async def measure(
    s: aiohttp.ClientSession, url: str, inflight: int, n: int, body: bytes
) -> tuple[float, list[float]]:
    """(wall seconds, sorted latencies) of ``n`` POSTs with ``inflight`` at once."""
    lat: list[float] = []
    sem = asyncio.Semaphore(inflight)
    headers = {"Content-Type": "application/json"}

    async def one() -> None:
        async with sem:
            t = time.perf_counter()
            async with s.post(url, data=body, headers=headers) as r:
                await r.read()
                assert r.status == 200, r.status
            lat.append(time.perf_counter() - t)

    t0 = time.perf_counter()
    if inflight == 1:
        for _ in range(n):
            await one()
    else:
        await asyncio.gather(*(one() for _ in range(n)))
    return time.perf_counter() - t0, sorted(lat)


def pct(sorted_lat: list[float], q: float) -> float:
    return sorted_lat[min(int(len(sorted_lat) * q), len(sorted_lat) - 1)] * 1e3


async def part_overhead(baselines: list[str] | None = None) -> list[list[str]]:
    """Paths to one canned upstream: direct, the zero-work relay, the proxy, and for each of
    ``baselines`` (checkouts of this repository) that checkout's proxy, side by side.

    At 1 in flight the paths take turns in blocks of ``OVERHEAD_BLOCK_1`` requests, so a change in
    machine speed (large and frequent on a shared VM) hits all alike; p50/p99 are over all their
    requests. At 256 in flight they take turns by rounds; the table shows per-path medians over
    rounds (req/s, p50, p99) and the median of the per-round throughput ratios. Each turn starts
    with the next path, so none always runs right after the same other one.
    """
    up_port, relay_port, px_port = (free_port() for _ in range(3))
    rng = random.Random(0)
    body = json.dumps(
        {
            "model": "bench-v1",
            "prompt": [rng.randrange(50000) for _ in range(300)],
            "max_tokens": 2,
            "logprobs": 0,
            "return_token_ids": True,
        }
    ).encode()
    rows = []
    med = statistics.median
    with subprocess_server([PY, __file__, "--_canned-upstream", str(up_port)]):
        upstream = f"http://127.0.0.1:{up_port}"
        await wait_http(upstream + "/health")
        relay_argv = [PY, __file__, "--_relay", str(relay_port), str(up_port)]
        proxy_argv = [PY, "-m", "asyncgrpo.proxy", "--upstream", upstream, "--log-level",
                      "WARNING", "--port"]  # fmt: skip
        with contextlib.ExitStack() as stack:
            stack.enter_context(subprocess_server(relay_argv))
            pids = {"proxy": stack.enter_context(subprocess_server([*proxy_argv, str(px_port)]))}
            paths = {
                "direct": upstream,
                "relay": f"http://127.0.0.1:{relay_port}",
                "proxy": f"http://127.0.0.1:{px_port}",
            }
            for baseline in baselines or []:  # its own code first on the path: run from it
                name, port = os.path.basename(os.path.abspath(baseline)), free_port()
                env = {**os.environ, "PYTHONPATH": os.path.abspath(baseline)}
                argv = [*proxy_argv, str(port)]
                pids[name] = stack.enter_context(subprocess_server(argv, env, baseline))
                paths[name] = f"http://127.0.0.1:{port}"
            for url in paths.values():
                await wait_http(url + "/health")
            for inflight in (1, 256):
                conn = aiohttp.TCPConnector(limit=inflight)
                async with aiohttp.ClientSession(connector=conn) as s:
                    lat: dict[str, list[float]] = {k: [] for k in paths}
                    p99s: dict[str, list[float]] = {k: [] for k in paths}  # per turn
                    p50s: dict[str, list[float]] = {k: [] for k in paths}
                    wall = dict.fromkeys(paths, 0.0)
                    rps: dict[str, list[float]] = {k: [] for k in paths}
                    cpu = dict.fromkeys(pids, 0.0)
                    n = OVERHEAD_BLOCK_1 if inflight == 1 else OVERHEAD_REQUESTS_256
                    turns = OVERHEAD_REQUESTS_1 // n if inflight == 1 else OVERHEAD_ROUNDS
                    for url in paths.values():  # warm-up: connections, caches
                        await measure(s, url + "/v1/completions", inflight, 4 * n // 5, body)
                    for turn in range(turns):  # each turn starts with the next path
                        order = list(paths.items())
                        for name, url in order[turn % len(order) :] + order[: turn % len(order)]:
                            c0 = cpu_s(pids[name].pid) if name in pids else 0.0
                            dt, got = await measure(s, url + "/v1/completions", inflight, n, body)
                            if name in pids:
                                cpu[name] += cpu_s(pids[name].pid) - c0
                            lat[name] += got
                            p50s[name].append(pct(got, 0.5))
                            p99s[name].append(pct(got, 0.99))
                            wall[name] += dt
                            rps[name].append(n / dt)
                    total = n * turns
                    if inflight == 1:  # over all requests
                        p50 = {k: pct(sorted(v), 0.5) for k, v in lat.items()}
                        p99 = {k: pct(sorted(v), 0.99) for k, v in lat.items()}
                    else:  # medians over rounds: one round slowed by the machine moves no column
                        p50 = {k: med(v) for k, v in p50s.items()}
                        p99 = {k: med(v) for k, v in p99s.items()}
                    for name in paths:
                        if inflight == 1:
                            rate = total / wall[name]
                            share = rate / (total / wall["direct"])
                        else:
                            rate = med(rps[name])
                            share = med(
                                a / b for a, b in zip(rps[name], rps["direct"], strict=True)
                            )
                        row = [
                            f"{inflight}",
                            name,
                            f"{rate:.0f}",
                            f"{p50[name]:.3f}",
                            f"{p99[name]:.3f}",
                        ]
                        if name == "direct":
                            row += ["", "", ""]
                        else:
                            row += [
                                f"{p50[name] - p50['direct']:+.3f}",
                                f"{100 * share:.0f} %",
                                f"{cpu[name] / total * 1e6:.0f}" if name in cpu else "",
                            ]
                        rows.append(row)
    return rows


# -- (d) stall, (e) floods: hostile clients ----------------------------------------------------

STALL_BODY_BYTES = 32 * 1024 * 1024 - 4096
FLOOD_TRAILER_BYTES = 48 * 1000 * 1000
FLOOD_NAMES, FLOOD_NAME_BYTES = 300, 64 * 1024
FLOOD_CHUNKED_BYTES = 8 * 1000 * 1000


def stall_bodies() -> dict[str, bytes]:
    """Two bodies just under 32 MiB (the default max_body_bytes) that cost the most to read."""
    n = (STALL_BODY_BYTES - 40) // 9  # '[[1234],' per prompt, +1 for the space json.dumps adds
    tokens = json.dumps({"model": "bench-v1", "prompt": [[1234]] * n})
    message = {"role": "user", "content": [{"type": "text", "text": "hi"}]}
    per = len(json.dumps(message)) + 2
    chat = json.dumps({"model": "bench-v1", "messages": [message] * (STALL_BODY_BYTES // per)})
    return {"tokens": tokens.encode(), "chat": chat.encode()}


async def stall_one(url: str, big: bytes, small: bytes) -> tuple[float, list[float]]:
    """(seconds the big request took, sorted latencies of the small ones sent meanwhile)."""
    conn = aiohttp.TCPConnector(limit=4)
    async with aiohttp.ClientSession(connector=conn) as s:
        headers = {"Content-Type": "application/json"}
        t0 = time.perf_counter()
        task = asyncio.create_task(s.post(url + "/v1/completions", data=big, headers=headers))
        lat = []
        while not task.done():
            t = time.perf_counter()
            async with s.post(url + "/v1/completions", data=small, headers=headers) as r:
                await r.read()
            lat.append(time.perf_counter() - t)
        resp = await task
        await resp.read()
        assert resp.status == 200, resp.status
        return time.perf_counter() - t0, sorted(lat)


def rss_mib(pid: int, field: str = "VmRSS") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


def trailer_flood(port: int) -> str:
    """One chunked request followed by FLOOD_TRAILER_BYTES of trailer fields; its status."""
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n"
        b"Content-Type: application/json\r\nConnection: close\r\n\r\n2\r\n{}\r\n0\r\n"
    )
    piece = b"".join(b"X-T%d: %s\r\n" % (i, b"a" * 8000) for i in range(125))  # 1 MB
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        try:
            sock.sendall(head)
            for _ in range(FLOOD_TRAILER_BYTES // len(piece)):
                sock.sendall(piece)
            sock.sendall(b"\r\n")
        except OSError:
            pass  # refused: the proxy closed the connection
        try:
            answer = sock.recv(64)
        except OSError:
            answer = b""
    return answer.split(b" ")[1].decode() if answer.startswith(b"HTTP/") else "closed"


def one_byte_chunks(port: int) -> str:
    """A FLOOD_CHUNKED_BYTES generation body in chunks of one byte each; its status."""
    body = b'{"model": "bench-v1", "prompt": "' + b"x" * (FLOOD_CHUNKED_BYTES - 34) + b'"}'
    wire = bytearray(6 * len(body))
    for i, part in enumerate((b"1", b"\r", b"\n", None, b"\r", b"\n")):
        wire[i::6] = body if part is None else part * len(body)
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n"
        b"Content-Type: application/json\r\nConnection: close\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", port), timeout=300) as sock:
        sock.sendall(head + wire + b"0\r\n\r\n")
        answer = sock.recv(64)
    return answer.split(b" ")[1].decode() if answer.startswith(b"HTTP/") else "closed"


async def chunk_flood(url: str, port: int, pid: int) -> tuple[str, float, float]:
    """(status, peak RSS MiB, slowest /health ms) while :func:`one_byte_chunks` runs."""
    sent = asyncio.create_task(asyncio.to_thread(one_byte_chunks, port))
    slowest = 0.0
    async with aiohttp.ClientSession() as s:
        while not sent.done():
            t = time.perf_counter()
            async with s.get(url + "/health") as r:
                await r.read()
            slowest = max(slowest, time.perf_counter() - t)
            await asyncio.sleep(0.02)
    return await sent, rss_mib(pid, "VmHWM"), slowest * 1e3


async def name_flood(url: str) -> tuple[dict[int, int], int]:
    """FLOOD_NAMES requests with distinct 64 KB model names: (statuses, bytes of /metrics)."""
    statuses: dict[int, int] = {}
    async with aiohttp.ClientSession() as s:
        for i in range(FLOOD_NAMES):
            name = f"{i:04d}" + "n" * (FLOOD_NAME_BYTES - 4)
            body = json.dumps({"model": name, "prompt": [1, 2, 3], "max_tokens": 1}).encode()
            async with s.post(
                url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
            ) as r:
                await r.read()
                statuses[r.status] = statuses.get(r.status, 0) + 1
        async with s.get(url + "/metrics") as r:
            metrics = await r.read()
    return statuses, len(metrics)


async def part_hostile(
    baselines: list[str] | None = None,
) -> tuple[list[list[str]], list[list[str]]]:
    """(d) and (e) for this checkout's proxy and each of ``baselines``, each a fresh proxy."""
    up_port = free_port()
    rng = random.Random(0)
    small = json.dumps(
        {"model": "bench-v1", "prompt": [rng.randrange(50000) for _ in range(300)], "max_tokens": 2}
    ).encode()
    bodies = stall_bodies()
    stall_rows, flood_rows = [], []
    checkouts = {
        "proxy": None,
        **{os.path.basename(os.path.abspath(b)): b for b in baselines or []},
    }
    with subprocess_server([PY, __file__, "--_canned-upstream", str(up_port)]):
        upstream = f"http://127.0.0.1:{up_port}"
        await wait_http(upstream + "/health")
        argv = [PY, "-m", "asyncgrpo.proxy", "--upstream", upstream, "--log-level", "ERROR",
                "--port"]  # fmt: skip
        for name, checkout in checkouts.items():
            env = cwd = None
            if checkout is not None:
                env = {**os.environ, "PYTHONPATH": os.path.abspath(checkout)}
                cwd = checkout
            for kind, big in bodies.items():
                port = free_port()
                with subprocess_server([*argv, str(port)], env, cwd):
                    url = f"http://127.0.0.1:{port}"
                    await wait_http(url + "/health")
                    await measure_small(url, small)
                    took, lat = await stall_one(url, big, small)
                stall_rows.append(
                    [
                        name,
                        kind,
                        f"{len(big) / 2**20:.1f}",
                        f"{took:.2f}",
                        str(len(lat)),
                        f"{pct(lat, 0.5):.1f}",
                        f"{pct(lat, 0.99):.1f}",
                        f"{lat[-1] * 1e3:.1f}",
                    ]
                )
            port = free_port()
            with subprocess_server([*argv, str(port)], env, cwd) as proc:
                url = f"http://127.0.0.1:{port}"
                await wait_http(url + "/health")
                await measure_small(url, small)
                start = rss_mib(proc.pid)
                status = await asyncio.to_thread(trailer_flood, port)
                after_trailers = rss_mib(proc.pid)
                statuses, metrics = await name_flood(url)
                after_names = rss_mib(proc.pid)
            port = free_port()
            with subprocess_server([*argv, str(port)], env, cwd) as proc:
                url = f"http://127.0.0.1:{port}"
                await wait_http(url + "/health")
                await measure_small(url, small)
                chunked, peak, slowest = await chunk_flood(url, port, proc.pid)
            flood_rows.append(
                [
                    name,
                    f"{start:.0f}",
                    status,
                    f"{after_trailers:.0f}",
                    " ".join(f"{k}x{v}" for k, v in sorted(statuses.items())),
                    f"{after_names:.0f}",
                    f"{metrics / 2**20:.2f}",
                    chunked,
                    f"{peak:.0f}",
                    f"{slowest:.0f}",
                ]
            )
    return stall_rows, flood_rows


async def measure_small(url: str, small: bytes) -> None:
    """Warm a fresh proxy up: connections, caches."""
    async with aiohttp.ClientSession() as s:
        await measure(s, url + "/v1/completions", 1, 50, small)


# -- (a) routing quality ------------------------------------------------------------------------


def grpo_prompts(n: int, seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    template = [rng.randrange(10, vocab) for _ in range(TEMPLATE_TOKENS)]
    return [
        template + [rng.randrange(10, vocab) for _ in range(rng.randrange(128, 257))]
        for _ in range(n)
    ]


async def routing_run(urls: list[str], routing: str, seed: int) -> list[str]:
    from asyncgrpo.proxy import ProxyConfig, serve_proxy

    cfg = ProxyConfig(upstreams=tuple(urls), port=0, routing=routing)
    async with serve_proxy(cfg) as base, aiohttp.ClientSession() as s:
        async with s.get(urls[0] + "/v1/models") as r:
            model = (await r.json())["data"][0]["id"]
        async with s.post(base + "/reset_prefix_cache") as r:
            assert r.status == 200, await r.text()
        prompts = grpo_prompts(PROMPTS, seed, vocab=300)
        h0, q0 = await prefix_cache(urls)
        sem = asyncio.Semaphore(INFLIGHT)

        async def one(p: list[int]) -> None:
            body = {"model": model, "prompt": p, "max_tokens": MAX_TOKENS, "logprobs": 0}
            async with sem, s.post(base + "/v1/completions", json=body) as r:
                await r.read()
                assert r.status == 200, r.status

        t0 = time.perf_counter()
        await asyncio.gather(*(one(p) for p in prompts for _ in range(G)))
        wall = time.perf_counter() - t0
        h1, q1 = await prefix_cache(urls)
        async with s.get(base + "/proxy/stats") as r:
            stats = await r.json()
    f = stats["fractions"]
    if not make_policy(routing).reads_prompt:  # it decides without the prompt
        a = u = sp = "-"
    else:
        a, u, sp = (f"{100 * f[k]:.1f} %" for k in ("affinity", "unmatched", "spill"))
    rate = (h1 - h0) / max(q1 - q0, 1)
    return [routing, str(stats["block_size"]), a, u, sp, f"{rate:.3f}", f"{wall:.1f}"]


async def part_routing(upstreams: list[str]) -> list[list[str]]:
    async def run(urls: list[str]) -> list[list[str]]:
        # Warm-up: the first request on a fresh replica takes ~16 s on CPU.
        async with aiohttp.ClientSession() as s:
            for url in urls:
                async with s.get(url + "/v1/models") as r:
                    model = (await r.json())["data"][0]["id"]
                body = {"model": model, "prompt": [11, 12], "max_tokens": 1}
                async with s.post(url + "/v1/completions", json=body) as r:
                    await r.read()
        # Every routing policy, the baseline first; each its own prompts (seed).
        return [
            await routing_run(urls, policy, seed=seed)
            for seed, policy in enumerate(ROUTING_POLICIES, start=1)
        ]

    if upstreams:
        return await run(upstreams)
    from asyncgrpo.serve import ServeConfig, launch_replicas
    from asyncgrpo.testing import make_tiny_model

    tmp = Path(tempfile.mkdtemp(prefix="bench-proxy-"))
    model = make_tiny_model(tmp / "model", seed=0)
    config = ServeConfig(
        model=str(model),
        replicas=2,
        dtype="float32",
        max_model_len=1024,
        kv_cache_gib=1,
        max_staleness=2,
        log_dir=str(tmp / "logs"),
    )
    async with launch_replicas(config) as replicas:
        return await run([r.url for r in replicas])


class _Recorder:
    """The callbacks the front and the pooled client register, doing what theirs do."""

    def on_message_begin(self) -> None:
        self.url, self.headers, self.body = b"", [], []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        pass

    def on_body(self, data: bytes) -> None:
        self.body.append(data)

    def on_message_complete(self) -> None:
        self.done = True


class _Bare:
    def on_message_complete(self) -> None:
        self.done = True


def part_parse(n: int = 100_000) -> list[list[str]]:
    """llhttp on a 7-header request with the (b) body and a 4-header canned answer."""
    import timeit

    import httptools

    body = json.dumps({"model": "bench-v1", "prompt": list(range(1000, 1300)), "max_tokens": 2})
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:8000\r\nUser-Agent: bench\r\n"
        b"Accept: */*\r\nAccept-Encoding: gzip\r\nConnection: keep-alive\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
        % (len(body), body.encode())
    )
    answer = (
        b"HTTP/1.1 200 OK\r\ndate: Mon, 30 Nov 2026 14:00:00 GMT\r\nserver: uvicorn\r\n"
        b"content-length: %d\r\ncontent-type: application/json\r\n\r\n%s" % (len(CANNED), CANNED)
    )
    rows = []
    for name, protocol in (("proxy's callbacks", _Recorder), ("on_message_complete only", _Bare)):
        req_s = timeit.timeit(
            lambda p=protocol: httptools.HttpRequestParser(p()).feed_data(request), number=n
        )
        ans_s = timeit.timeit(
            lambda p=protocol: httptools.HttpResponseParser(p()).feed_data(answer), number=n
        )
        rows.append([name, f"{req_s / n * 1e6:.2f}", f"{ans_s / n * 1e6:.2f}"])
    return rows


def table(title: str, header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    out = [title, line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    return "\n".join(out + [line(r) for r in rows])


async def main(args: argparse.Namespace) -> None:
    if args.part in ("routing", "all"):
        rows = await part_routing(args.upstream or [])
        print(
            table(
                f"(a) routing: {PROMPTS} prompts x G={G}, {INFLIGHT} in flight, shared "
                f"{TEMPLATE_TOKENS}-token template, 128-256 own tokens, max_tokens={MAX_TOKENS}",
                [
                    "routing",
                    "block",
                    "affinity",
                    "unmatched",
                    "spilled",
                    "prefix hit rate",
                    "wall s",
                ],
                rows,
            ),
            flush=True,
        )
    if args.part in ("overhead", "all"):
        rows = await part_overhead(args.baseline)
        print(
            table(
                f"(b) overhead vs a canned upstream (300-token prompt body); 1 in flight: "
                f"{OVERHEAD_REQUESTS_1} requests per path in turns of {OVERHEAD_BLOCK_1}; 256 in "
                f"flight: medians of {OVERHEAD_ROUNDS} rounds of {OVERHEAD_REQUESTS_256}",
                [
                    "in flight",
                    "path",
                    "req/s",
                    "p50 ms",
                    "p99 ms",
                    "added p50 ms",
                    "of direct",
                    "proxy CPU us/req",
                ],
                rows,
            ),
            flush=True,
        )
    if args.part in ("hostile", "all"):
        stall, floods = await part_hostile(args.baseline)
        print(
            table(
                "(d) stall: small requests (300-token prompt, one at a time) while one ~32 MiB body "
                "goes through the proxy; ms",
                ["path", "body", "MiB", "big s", "small n", "p50 ms", "p99 ms", "max ms"],
                stall,
            ),
            flush=True,
        )
        print(
            table(
                f"(e) floods: proxy RSS (MiB) at start, after {FLOOD_TRAILER_BYTES / 1e6:.0f} MB of "
                f"trailers on one request, after {FLOOD_NAMES} requests of {FLOOD_NAME_BYTES // 1024}"
                f" KB model names; size of /metrics then; a {FLOOD_CHUNKED_BYTES / 1e6:.0f} MB body "
                "in 1-byte chunks: status, peak RSS, slowest /health meanwhile",
                [
                    "path",
                    "start MiB",
                    "trailers: status",
                    "MiB",
                    "names: statuses",
                    "MiB",
                    "/metrics MiB",
                    "chunks: status",
                    "peak MiB",
                    "/health max ms",
                ],
                floods,
            ),
            flush=True,
        )
    if args.part in ("parse", "all"):
        print(
            table(
                "(c) llhttp (httptools) parse of one request (7 headers, (b)'s body) and one answer "
                "(4 headers), us each, parser creation included",
                ["callbacks", "request us", "answer us"],
                part_parse(),
            ),
            flush=True,
        )


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--_canned-upstream":
        run_canned_upstream(int(sys.argv[2]))
        sys.exit(0)
    if len(sys.argv) == 4 and sys.argv[1] == "--_relay":
        run_relay(int(sys.argv[2]), int(sys.argv[3]))
        sys.exit(0)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--part", choices=("all", "routing", "overhead", "parse", "hostile"), default="all"
    )
    parser.add_argument("--upstream", action="append", help="reuse running vLLM replicas")
    parser.add_argument(
        "--baseline",
        metavar="DIR",
        action="append",
        help="also measure the proxy of this checkout (A/B), e.g. ../main; repeatable; the "
        "table names it by the directory's name",
    )
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    try:
        import uvloop

        uvloop.run(main(parser.parse_args()))
    except ImportError:
        asyncio.run(main(parser.parse_args()))
