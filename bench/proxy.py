"""Proxy benchmark, side by side in one run.

(a) Routing quality on real vLLM CPU replicas under a GRPO-shaped load (G rollouts per prompt,
    one shared chat-template prefix, 128-256 own prompt tokens, many in flight): round-robin vs
    our affinity router. Reports affinity / unmatched / spilled, the replicas' own prefix-cache hit
    rate (vllm:prefix_cache_hits_total / queries_total deltas) and wall time.
(b) Overhead against a canned local upstream (an aiohttp app returning a fixed completion):
    requests/s and p50/p99 latency direct vs through the proxy, 1 and 256 in flight.

    python bench/proxy.py                      # both parts; starts 2 vLLM replicas of a tiny model
    python bench/proxy.py --part overhead      # (b) only, ~1 min
    python bench/proxy.py --upstream URL --upstream URL --part routing   # reuse running replicas
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

from asyncgrpo.testing.vllm_metrics import prefix_cache

# -- defaults -----------------------------------------------------------------------------------
PROMPTS = 64
G = 8
INFLIGHT = 64
TEMPLATE_TOKENS = 151
MAX_TOKENS = 16
OVERHEAD_REQUESTS_1 = 1000  # per round
OVERHEAD_REQUESTS_256 = 8000
OVERHEAD_ROUNDS = 5
PY = sys.executable

CANNED = json.dumps(
    {
        "id": "cmpl-bench",
        "object": "text_completion",
        "created": 0,
        "model": "bench",
        "choices": [
            {"index": 0, "text": " 42", "logprobs": None, "finish_reason": "length",
             "token_ids": [52, 50]}
        ],
        "usage": {"prompt_tokens": 300, "completion_tokens": 2, "total_tokens": 302},
    }
).encode()  # fmt: skip


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
def subprocess_server(argv: list[str], env: dict | None = None):
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
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

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health)
    app.router.add_get("/server_info", server_info)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


async def measure(
    s: aiohttp.ClientSession, url: str, inflight: int, n: int, body: bytes
) -> tuple[float, float, float]:
    """(requests/s, p50 ms, p99 ms) for ``n`` POSTs with ``inflight`` at once."""
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
    wall = time.perf_counter() - t0
    lat.sort()
    return n / wall, lat[len(lat) // 2] * 1e3, lat[int(len(lat) * 0.99)] * 1e3


async def part_overhead() -> list[list[str]]:
    """Direct and proxied rounds alternate (``OVERHEAD_ROUNDS`` each), so a change in machine load
    hits both; the table shows per-path medians and the median of the per-round differences."""
    up_port, px_port = free_port(), free_port()
    rng = random.Random(0)
    body = json.dumps(
        {"model": "bench-v1", "prompt": [rng.randrange(50000) for _ in range(300)],
         "max_tokens": 2, "logprobs": 0, "return_token_ids": True}
    ).encode()  # fmt: skip
    rows = []
    med = statistics.median
    with subprocess_server([PY, __file__, "--_canned-upstream", str(up_port)]):
        upstream = f"http://127.0.0.1:{up_port}"
        await wait_http(upstream + "/health")
        proxy_argv = [PY, "-m", "asyncgrpo.proxy", "--upstream", upstream, "--port",
                      str(px_port), "--log-level", "WARNING"]  # fmt: skip
        with subprocess_server(proxy_argv) as px:
            proxy = f"http://127.0.0.1:{px_port}"
            await wait_http(proxy + "/health")
            for inflight, n in ((1, OVERHEAD_REQUESTS_1), (256, OVERHEAD_REQUESTS_256)):
                conn = aiohttp.TCPConnector(limit=inflight)
                async with aiohttp.ClientSession(connector=conn) as s:
                    for url in (upstream, proxy):  # warm-up: connections, caches
                        await measure(s, url + "/v1/completions", inflight, n // 5, body)
                    d, p, cpu = [], [], []
                    for _ in range(OVERHEAD_ROUNDS):
                        d.append(await measure(s, upstream + "/v1/completions", inflight, n, body))
                        c0 = cpu_s(px.pid)
                        p.append(await measure(s, proxy + "/v1/completions", inflight, n, body))
                        cpu.append((cpu_s(px.pid) - c0) / n * 1e6)
                added = med(b[1] - a[1] for a, b in zip(d, p, strict=True))
                share = med(b[0] / a[0] for a, b in zip(d, p, strict=True))
                for name, runs in (("direct", d), ("proxy", p)):
                    row = [f"{inflight}", name, f"{med(r[0] for r in runs):.0f}",
                           f"{med(r[1] for r in runs):.3f}", f"{med(r[2] for r in runs):.3f}"]  # fmt: skip
                    row += (
                        [f"{added:+.3f}", f"{100 * share:.0f} %", f"{med(cpu):.0f}"]
                        if name == "proxy"
                        else ["", "", ""]
                    )
                    rows.append(row)
    return rows


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
    if routing == "round_robin":
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
        return [
            await routing_run(urls, "round_robin", seed=1),
            await routing_run(urls, "affinity", seed=2),
        ]

    if upstreams:
        return await run(upstreams)
    from asyncgrpo.serve import ServeConfig, launch_replicas
    from asyncgrpo.testing import make_tiny_model

    tmp = Path(tempfile.mkdtemp(prefix="bench-proxy-"))
    model = make_tiny_model(tmp / "model", seed=0)
    config = ServeConfig(model=str(model), replicas=2, dtype="float32", max_model_len=1024,
                         kv_cache_gib=1, max_staleness=2, log_dir=str(tmp / "logs"))  # fmt: skip
    async with launch_replicas(config) as replicas:
        return await run([r.url for r in replicas])


def table(title: str, header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    out = [title, line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    return "\n".join(out + [line(r) for r in rows])


async def main(args: argparse.Namespace) -> None:
    if args.part in ("routing", "all"):
        rows = await part_routing(args.upstream or [])
        print(table(
            f"(a) routing: {PROMPTS} prompts x G={G}, {INFLIGHT} in flight, shared "
            f"{TEMPLATE_TOKENS}-token template, 128-256 own tokens, max_tokens={MAX_TOKENS}",
            ["routing", "block", "affinity", "unmatched", "spilled", "prefix hit rate", "wall s"],
            rows,
        ), flush=True)  # fmt: skip
    if args.part in ("overhead", "all"):
        rows = await part_overhead()
        print(table(
            f"(b) overhead vs a canned upstream (300-token prompt body); medians of "
            f"{OVERHEAD_ROUNDS} alternating rounds",
            ["in flight", "path", "req/s", "p50 ms", "p99 ms", "added p50 ms", "of direct",
             "proxy CPU us/req"],
            rows,
        ), flush=True)  # fmt: skip


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--_canned-upstream":
        run_canned_upstream(int(sys.argv[2]))
        sys.exit(0)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("all", "routing", "overhead"), default="all")
    parser.add_argument("--upstream", action="append", help="reuse running vLLM replicas")
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    try:
        import uvloop

        uvloop.run(main(parser.parse_args()))
    except ImportError:
        asyncio.run(main(parser.parse_args()))
