"""Shared fleets: several training runs on one set of replicas, side by side in one run.

(a) ``--part sync``: does one run's adapter sync stop another run's generation? Run B streams
    completions under its adapter (``--inflight`` at once, every chunk timed), run A publishes
    and loads a new version every ``--gap`` seconds through the same standalone proxy in front
    of two float32 vLLM replicas of the tiny model. Two ways to sync take turns: the old one
    (``/pause?mode=keep``, load on every replica, ``/resume``) and asyncgrpo's (load while the
    replicas serve). Per way: B's generated tokens/s while A syncs and in the ``--gap`` seconds
    before each of A's syncs, and A's sync time.
(b) ``--part sweep``: N tiny training runs (``asyncgrpo train`` processes, the demo recipe,
    different seeds) share two replicas through one standalone proxy, for N = 1, 2, 4; each run
    alone on two replicas of its own is the N = 1 row run once per point of the sweep. Total
    generated tokens/s while every run trains, each run's median step time, and how evenly
    generation was shared (slowest / fastest run's tokens/s, Jain's index).

    python bench/sweep.py --part sync      # ~4 minutes
    python bench/sweep.py --part sweep --runs 1,2    # then --runs 4: each under ~12 minutes
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp

PY = sys.executable
# -- (a) defaults ---------------------------------------------------------------------------------
SYNC_ROUNDS = 12
GAP_S = 1.5
INFLIGHT = 32
PROMPT_TOKENS = 64
MAX_TOKENS = 48


def free_port() -> int:
    from asyncgrpo.processes import free_port as pick

    return pick()


@contextlib.contextmanager
def proxy_process(upstreams: list[str], log: Path, *extra: str) -> Iterator[str]:
    """``python -m asyncgrpo.proxy`` in front of ``upstreams``, its own process (as a user runs
    it): yields its URL once it answers."""
    port = free_port()
    argv = [PY, "-m", "asyncgrpo.proxy", "--port", str(port), *extra]
    for url in upstreams:
        argv += ["--upstream", url]
    from asyncgrpo.processes import parent_death_argv

    with log.open("ab") as out:
        proc = subprocess.Popen(
            parent_death_argv(argv), stdout=out, stderr=out, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                import urllib.request

                urllib.request.urlopen(url + "/proxy/upstreams", timeout=2).read()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the proxy did not start; log {log}") from None
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# -- (a) one run's syncs against another run's generation -----------------------------------------


class Stream:
    """Run B: ``inflight`` streamed completions at a time under ``model``; every chunk's arrival
    time and token count in ``chunks``."""

    def __init__(self, url: str, model: str, inflight: int) -> None:
        self.url, self.model, self.inflight = url + "/v1/completions", model, inflight
        self.chunks: list[tuple[float, int]] = []
        self.rng = random.Random(0)

    async def run(self, seconds: float) -> None:
        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            workers = [asyncio.create_task(self._worker(session)) for _ in range(self.inflight)]
            await asyncio.sleep(seconds)
            for w in workers:
                w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)

    async def _worker(self, session: aiohttp.ClientSession) -> None:
        while True:
            body = {
                "model": self.model,
                "prompt": [self.rng.randrange(10, 300) for _ in range(PROMPT_TOKENS)],
                "max_tokens": MAX_TOKENS,
                "temperature": 1.0,
                "ignore_eos": True,
                "stream": True,
                "return_token_ids": True,
            }
            async with session.post(self.url, json=body) as resp:
                resp.raise_for_status()
                async for line in resp.content:
                    if not line.startswith(b"data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    n = sum(len(c.get("token_ids") or [0]) for c in chunk.get("choices", []))
                    self.chunks.append((time.perf_counter(), n))


def stream_process(url: str, model: str, inflight: int, seconds: float, out: str) -> None:
    """Run B in a process of its own (what A does in the bench's must not delay B's reads);
    ``time.perf_counter`` is CLOCK_MONOTONIC, the same clock in every process."""
    stream = Stream(url, model, inflight)
    asyncio.run(stream.run(seconds))
    Path(out).write_text(json.dumps(stream.chunks))


def tokens(chunks: list[tuple[float, int]], start: float, end: float) -> int:
    return sum(n for t, n in chunks if start <= t < end)


def pausing_loader(client: object):  # the old sync: /pause?mode=keep, load, /resume
    from asyncgrpo.run.sync import ProxyLoader

    class Pausing(ProxyLoader):
        async def load(self, name: str, location: str) -> None:
            await self.client.pause("keep")
            try:
                await super().load(name, location)
            finally:
                await self.client.resume()

    return Pausing(client, fetching=True)  # type: ignore[arg-type]


async def part_sync(args: argparse.Namespace, work: Path) -> None:
    import multiprocessing

    from asyncgrpo.run.sync import AdapterSync, ProxyLoader, TransportSource
    from asyncgrpo.serve import launch_replicas
    from asyncgrpo.store.adapters import AdapterStore
    from asyncgrpo.testing import make_lora_adapter, make_tiny_model, tiny_serve_config
    from asyncgrpo.transport import open_transport
    from asyncgrpo.vllm.client import VLLMClient

    model = make_tiny_model(work / "model")
    adapters = [
        make_lora_adapter(model, work / f"adapter-{i}", r=1, alpha=2, seed=i) for i in (0, 1)
    ]
    store_dir = work / "store"
    serve = tiny_serve_config(
        model,
        replicas=2,
        runs=2,
        max_staleness=1,
        log_dir=str(work / "logs"),
        nice=args.nice,
        transports=(str(store_dir),),
        adapter_cache_dir=str(work / "replica-cache"),
    )
    ways = ("pause, load, resume (before)", "load while serving (asyncgrpo)")
    spans: dict[str, list[tuple[float, float, float, float, float]]] = {w: [] for w in ways}
    async with launch_replicas(serve) as replicas:
        with proxy_process([r.url for r in replicas], work / "proxy.log") as url:
            async with VLLMClient(url) as client:
                store = AdapterStore(open_transport(str(store_dir)))
                loaders = dict(
                    zip(
                        ways,
                        (pausing_loader(client), ProxyLoader(client, fetching=True)),
                        strict=True,
                    )
                )
                b = AdapterSync(
                    store=store,
                    source=TransportSource(store),
                    prefix="benchb",
                    loader=loaders[ways[1]],
                    max_staleness=1,
                )
                a = AdapterSync(
                    store=store,
                    source=TransportSource(store),
                    prefix="bencha",
                    loader=loaders[ways[1]],
                    max_staleness=1,
                )
                await b.sync(0, adapters[1], step=0)
                chunks_file = work / "chunks.json"
                seconds = args.warmup_s + args.rounds * len(ways) * (args.gap + 3) + 10
                ctx = multiprocessing.get_context("spawn")
                proc = ctx.Process(
                    target=stream_process,
                    args=(url, b.name(0), args.inflight, seconds, str(chunks_file)),
                )
                proc.start()
                try:
                    await asyncio.sleep(args.warmup_s)  # vLLM's first batches are slow
                    version = 0
                    for i in range(args.rounds):
                        for way in ways:
                            before = time.perf_counter()
                            await asyncio.sleep(args.gap)
                            a.loader = loaders[way]
                            t0 = time.perf_counter()
                            m = await a.sync(version, adapters[0], step=version)
                            t1 = time.perf_counter()
                            version += 1
                            load_from = (
                                t0 + m["perf/weight_sync/publish_s"] + m["perf/weight_sync/fetch_s"]
                            )
                            if i:  # the first round warms both ways up
                                spans[way].append(
                                    (
                                        before,
                                        t0,
                                        t1,
                                        load_from,
                                        load_from + m["perf/weight_sync/load_s"],
                                    )
                                )
                    end = time.perf_counter()
                finally:
                    await asyncio.to_thread(proc.join)
                    await a.unload_all()
                    await b.unload_all()
    chunks = json.loads(chunks_file.read_text())
    if not chunks or chunks[-1][0] < end:
        raise RuntimeError("run B stopped before run A's last sync: raise its duration")

    def rate(windows: list[tuple[float, float]]) -> float:
        return sum(tokens(chunks, s, e) for s, e in windows) / sum(e - s for s, e in windows)

    print(
        f"\n(a) run B streams {args.inflight} completions at a time ({PROMPT_TOKENS}-token "
        f"prompts, {MAX_TOKENS} tokens each, its own process) while run A syncs every "
        f"{args.gap:g} s; 2 float32 vLLM replicas of the tiny model (nice {args.nice}) behind one "
        f"proxy process; {args.rounds - 1} syncs per way after one warm-up round, the ways in "
        "turns"
    )
    print(
        "| A's sync                       | A sync p50 ms | A load p50 ms | B tok/s before | "
        "B tok/s during sync | during / before | B tok/s during load | during load / before |"
    )
    print(
        "|--------------------------------|---------------|---------------|----------------|"
        "---------------------|-----------------|---------------------|----------------------|"
    )
    for way, rows in spans.items():
        before = rate([(s, t0) for s, t0, *_ in rows])
        during = rate([(t0, t1) for _, t0, t1, *_ in rows])
        loading = rate([(l0, l1) for *_, l0, l1 in rows])
        sync_ms = statistics.median([(t1 - t0) * 1e3 for _, t0, t1, *_ in rows])
        load_ms = statistics.median([(l1 - l0) * 1e3 for *_, l0, l1 in rows])
        print(
            f"| {way:<30} | {sync_ms:>13.1f} | {load_ms:>13.1f} | {before:>14.0f} | "
            f"{during:>19.0f} | {during / before:>15.0%} | {loading:>19.0f} | "
            f"{loading / before:>20.0%} |"
        )


# -- (b) N runs sharing two replicas, against each run alone -------------------------------------


def recipe() -> dict:
    """The demo recipe, ``examples/tiny_cpu.yaml``."""
    import yaml

    return yaml.safe_load(
        (Path(__file__).resolve().parents[1] / "examples" / "tiny_cpu.yaml").read_text()
    )


def run_config(work: Path, model: Path, proxy_url: str, name: str, seed: int, steps: int) -> Path:
    """The demo recipe for one run, sent to the shared proxy."""
    import yaml

    data = recipe()
    data.update(model=str(model), output_dir=str(work / "runs"), run_name=name, seed=seed)
    data["serve"] = {"replicas": 0}
    data["proxy"] = {"upstreams": [proxy_url]}
    data["trainer"].update(max_steps=steps, save_steps=0)
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


async def train_together(configs: list[Path], work: Path) -> list[list[dict]]:
    """``asyncgrpo train`` per config, all at once, each its own process; their metrics."""
    from asyncgrpo.processes import start_group
    from asyncgrpo.run.metrics import read_metrics

    procs = []
    for cfg in configs:
        with (work / f"{cfg.stem}.log").open("wb") as log:
            argv = [PY, "-m", "asyncgrpo.cli.main", "train", str(cfg)]
            procs.append(await start_group(argv, stdout=log, stderr=log))
    for proc, cfg in zip(procs, configs, strict=True):
        code = await asyncio.wait_for(proc.wait(), 900)
        await proc.aclose()
        if code != 0:
            raise RuntimeError(f"{cfg.stem} failed: see {work / (cfg.stem + '.log')}")
    return [read_metrics(work / "runs" / cfg.stem) for cfg in configs]


def _at(records: list[dict], t: float) -> float:
    """Generated tokens by time ``t``, interpolated between the steps around it."""
    points = [(r["time"], r["rollout/generated_tokens_total"]) for r in records]
    for (t0, n0), (t1, n1) in itertools.pairwise(points):
        if t0 <= t <= t1:
            return n0 + (n1 - n0) * (t - t0) / max(t1 - t0, 1e-9)
    return points[0][1] if t < points[0][0] else points[-1][1]


def measure(runs: list[list[dict]], warmup: int) -> dict[str, float]:
    """While every run trains (from the last one's step ``warmup`` to the first one's end): the
    runs' tokens/s, their sum, each run's median step time, evenness (slowest / fastest, Jain)."""
    start = max(r[warmup - 1]["time"] for r in runs)
    end = min(r[-1]["time"] for r in runs)
    rates = [(_at(r, end) - _at(r, start)) / (end - start) for r in runs]
    steps = [statistics.median(x["perf/step_s"] for x in r[warmup:]) for r in runs]
    return {
        "total": sum(rates),
        "step": statistics.median(steps),
        "min_max": min(rates) / max(rates),
        "jain": sum(rates) ** 2 / (len(rates) * sum(x * x for x in rates)),
        "seconds": end - start,
    }


async def part_sweep(args: argparse.Namespace, work: Path) -> None:
    from asyncgrpo.serve import launch_replicas
    from asyncgrpo.testing import make_tiny_model, tiny_serve_config

    counts = sorted({int(n) for n in args.runs.split(",")})
    model = make_tiny_model(work / "model")
    staleness = recipe()["trainer"]["max_staleness"]
    serve = tiny_serve_config(
        model,
        replicas=2,
        runs=max(counts),
        max_staleness=staleness,
        log_dir=str(work / "logs"),
        max_model_len=512,
        transports=(str(work / "runs"),),
        adapter_cache_dir=str(work / "replica-cache"),
    )
    rows = []
    async with launch_replicas(serve) as replicas:
        with proxy_process([r.url for r in replicas], work / "proxy.log") as url:
            alone: list[dict[str, float]] = []
            for seed in range(max(counts)):  # each point alone on the two replicas
                cfg = run_config(work, model, url, f"alone-{seed}", seed, args.steps)
                alone.append(measure(await train_together([cfg], work), args.warmup_steps))
                print(f"alone seed {seed}: {alone[-1]}", flush=True)
            for n in counts:
                if n == 1:
                    shared = alone[0]
                else:
                    cfgs = [
                        run_config(work, model, url, f"shared{n}-{seed}", seed, args.steps)
                        for seed in range(n)
                    ]
                    runs = await train_together(cfgs, work)
                    shared = measure(runs, args.warmup_steps)
                    print(f"{n} shared: {shared}", flush=True)
                own = alone[:n]
                rows.append(
                    (
                        n,
                        shared,
                        sum(a["total"] for a in own),
                        statistics.median(a["step"] for a in own),
                    )
                )
    print(
        f"\n(b) the demo recipe (examples/tiny_cpu.yaml: tiny model, 32 samples/step, G=8, "
        f"max_staleness {staleness}, a sync every step), {args.steps} steps per run, {args.warmup_steps} warm-up steps left out; "
        "shared: N `asyncgrpo train` processes at once through one proxy process in front of "
        "2 float32 vLLM replicas; own fleets: each of the N runs alone on those 2 replicas, one "
        "after the other (what N fleets of 2 replicas would give)"
    )
    print(
        "| runs | replicas shared | total tok/s | per-run median step s | slowest/fastest run "
        "| Jain | replicas own fleets | total tok/s own fleets | median step s own fleets |"
    )
    print(
        "|------|-----------------|-------------|-----------------------|---------------------"
        "|------|---------------------|------------------------|--------------------------|"
    )
    for n, shared, own_total, own_step in rows:
        print(
            f"| {n:>4} | {2:>15} | {shared['total']:>11.0f} | {shared['step']:>21.2f} | "
            f"{shared['min_max']:>19.2f} | {shared['jain']:>4.2f} | {2 * n:>19} | "
            f"{own_total:>22.0f} | {own_step:>24.2f} |"
        )


# -- main ------------------------------------------------------------------------------------------


async def run(args: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="bench-sweep-"))
    print(f"work directory {work}")
    if args.part == "sync":
        await part_sync(args, work)
    else:
        await part_sweep(args, work)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=("sync", "sweep"), default="sync")
    p.add_argument("--rounds", type=int, default=SYNC_ROUNDS, help="(a) syncs per way, + 1 warm-up")
    p.add_argument("--gap", type=float, default=GAP_S, help="(a) seconds between A's syncs")
    p.add_argument("--inflight", type=int, default=INFLIGHT, help="(a) B's streams at once")
    p.add_argument("--warmup-s", type=float, default=20.0, help="(a) B alone before A starts")
    p.add_argument("--nice", type=int, default=0, help="(a) the replicas' nice value")
    p.add_argument("--runs", default="1,2,4", help="(b) how many runs share the replicas")
    p.add_argument("--steps", type=int, default=20, help="(b) steps per run")
    p.add_argument("--warmup-steps", type=int, default=3, help="(b) steps left out at the start")
    asyncio.run(run(p.parse_args()))


if __name__ == "__main__":
    main()
