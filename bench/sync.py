"""Adapter sync time, side by side in one run: who fetches, and from which storage.

(a) End to end on two real float32 vLLM replicas of the tiny model behind the proxy: one
    ``AdapterSync.sync`` = publish, (trainer-side fetch), all-or-nothing load while the replicas
    keep serving, unload of the version that left the window. Variants take turns every round:

    * ``path, shared dir``: the trainer fetches the version into its cache and hands the replicas
      that path (only works when they share its disk: the old way);
    * ``fetch, shared dir``: the replicas fetch and verify it themselves from a directory store;
    * ``fetch, S3 loopback``: the replicas fetch it themselves from S3 (moto, in a subprocess).

(b) A Qwen2.5-1.5B-shaped LoRA r=1 all-linear adapter (4.67 MB, the shapes of bench/transport.py):
    publish, then two replica-side fetchers (asyncgrpo.serve.adapter_fetch, what the vLLM plugin
    runs) fetching and verifying it at once, from a directory and from S3. Loading it in vLLM
    would need the 1.5B base model in two replicas; on this 2-core, 24 GiB CPU host that is not
    run (see the note printed with the table).

Run: ``python bench/sync.py [--rounds 20] [--warmup 2] [--parts ab]`` (about 4 minutes).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from transport import pct, start_moto, write_adapter

# ---- defaults -------------------------------------------------------------------------------
ROUNDS, WARMUP = 20, 2
BUCKET = "bench-bucket"  # start_moto creates it
S3_ENV = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_REGION": "us-east-1"}
PARTS_KEYS = (
    "perf/weight_sync_s",
    "perf/weight_sync/publish_s",
    "perf/weight_sync/fetch_s",
    "perf/weight_sync/load_s",
    "perf/weight_sync/unload_s",
)


def row(label: str, seconds: list[float]) -> str:
    ms = [s * 1e3 for s in seconds]
    return f"| {label:<34} | {statistics.median(ms):>8.1f} | {pct(ms, 0.95):>8.1f} |"


async def part_a(args: argparse.Namespace, work: Path, s3_url: str) -> None:
    from asyncgrpo.proxy import ProxyConfig, serve_proxy
    from asyncgrpo.run.sync import AdapterSync, LocalCacheSource, ProxyLoader, TransportSource
    from asyncgrpo.serve import launch_replicas
    from asyncgrpo.store.adapters import AdapterStore
    from asyncgrpo.testing import make_lora_adapter, make_tiny_model, tiny_serve_config
    from asyncgrpo.transport import open_transport
    from asyncgrpo.vllm.client import VLLMClient

    model = make_tiny_model(work / "model")
    adapter = make_lora_adapter(model, work / "adapter", r=1, alpha=2)
    shared = work / "shared"
    serve = tiny_serve_config(
        model,
        replicas=2,
        log_dir=str(work / "logs"),
        transports=(str(shared), s3_url),
        adapter_cache_dir=str(work / "replica-cache"),
        max_staleness=1,
    )
    async with launch_replicas(serve) as replicas:
        proxy_cfg = ProxyConfig(
            upstreams=tuple(r.url for r in replicas), port=0, lora_roots=(str(work / "cache"),)
        )
        async with serve_proxy(proxy_cfg) as base, VLLMClient(base) as client:
            dir_store = AdapterStore(open_transport(str(shared)))
            s3_store = AdapterStore(open_transport(s3_url))
            variants = {
                "path, shared dir": (dir_store, LocalCacheSource(dir_store, work / "cache"), False),
                "fetch, shared dir": (dir_store, TransportSource(dir_store), True),
                "fetch, S3 loopback": (s3_store, TransportSource(s3_store), True),
            }
            syncs = {
                label: AdapterSync(
                    store=store,
                    source=source,
                    prefix=f"bench{i}",
                    loader=ProxyLoader(client, fetching=fetching),
                    max_staleness=1,
                )
                for i, (label, (store, source, fetching)) in enumerate(variants.items())
            }
            results: dict[str, dict[str, list[float]]] = {v: {} for v in variants}
            try:
                for i in range(args.warmup + args.rounds):
                    for label, sync in syncs.items():  # turns: load changes hit every variant
                        metrics = await sync.sync(i, adapter, step=i)
                        if i >= args.warmup:
                            for key in PARTS_KEYS:
                                results[label].setdefault(key, []).append(metrics[key])
            finally:
                for sync in syncs.values():
                    await sync.unload_all()
    print(
        f"\n(a) one sync end to end, tiny model, 2 float32 vLLM replicas behind the proxy, "
        f"{args.rounds} syncs per variant after {args.warmup} warm-up, in turns"
    )
    print(f"| {'variant / phase':<34} | {'p50 ms':>8} | {'p95 ms':>8} |")
    print(f"|{'-' * 36}|{'-' * 10}|{'-' * 10}|")
    for label, parts in results.items():
        print(row(f"{label}: total", parts["perf/weight_sync_s"]))
        for key in PARTS_KEYS[1:]:
            print(row(f"  {key.rsplit('/', 1)[1].removesuffix('_s')}", parts[key]))


async def part_b(args: argparse.Namespace, work: Path, s3_url: str) -> None:
    from asyncgrpo.serve.adapter_fetch import AdapterFetcher, adapter_uri
    from asyncgrpo.store.adapters import AdapterStore
    from asyncgrpo.transport import open_transport

    src = work / "qwen-adapter"
    size = write_adapter(src, 1)
    shared = work / "shared-b"
    results: dict[str, list[float]] = {}
    stores = {"shared dir": str(shared), "S3 loopback": s3_url}
    fetchers = {
        label: [AdapterFetcher([root], work / f"replica{r}-{i}") for r in range(2)]
        for i, (label, root) in enumerate(stores.items())
    }
    for i in range(args.warmup + args.rounds):
        for label, root in stores.items():
            store = AdapterStore(open_transport(root))
            t0 = time.perf_counter()
            await store.publish("qwen", i, src, step=i)
            t1 = time.perf_counter()
            ref = fetchers[label][0].resolve(
                adapter_uri(store.transport.url, "adapters", "qwen", i)
            )
            await asyncio.gather(*(f.fetch(ref) for f in fetchers[label]))
            t2 = time.perf_counter()
            for f in fetchers[label]:
                f.prune([])
            if i >= args.warmup:
                results.setdefault(f"{label}: publish", []).append(t1 - t0)
                results.setdefault(f"{label}: 2 replicas fetch+verify", []).append(t2 - t1)
                results.setdefault(f"{label}: publish + fetch", []).append(t2 - t0)
    print(
        f"\n(b) Qwen2.5-1.5B-shaped LoRA r=1 all-linear ({size / 1e6:.2f} MB), "
        f"publish then two replica-side fetchers at once, {args.rounds} rounds"
    )
    print(f"| {'variant / phase':<34} | {'p50 ms':>8} | {'p95 ms':>8} |")
    print(f"|{'-' * 36}|{'-' * 10}|{'-' * 10}|")
    for label, seconds in results.items():
        print(row(label, seconds))
    print(
        "(loading it needs Qwen2.5-1.5B in two vLLM replicas: ~2x3 GB bf16 plus KV on a 2-core "
        "CPU host, not run here; the load itself is vLLM's ~15 ms per adapter on the tiny "
        "model, see (a))"
    )


async def run(args: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="bench-sync-"))
    proc, endpoint = start_moto()
    os.environ.update(S3_ENV, AWS_ENDPOINT_URL=endpoint)  # replicas inherit it
    s3_url = f"s3://{BUCKET}/sync"
    try:
        if "a" in args.parts:
            await part_a(args, work, s3_url)
        if "b" in args.parts:
            await part_b(args, work, s3_url)
    finally:
        proc.terminate()
        proc.wait(10)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=ROUNDS)
    p.add_argument("--warmup", type=int, default=WARMUP)
    p.add_argument("--parts", default="ab", help="a: end to end on vLLM, b: 1.5B-shaped adapter")
    asyncio.run(run(p.parse_args()))


if __name__ == "__main__":
    main()
