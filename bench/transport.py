"""Adapter publish + fetch latency: plain file copy vs local transport vs S3, Azure Blob and GCS
emulators on loopback.

The adapter has the exact tensor shapes of Qwen2.5-1.5B with LoRA r=1 on all linear layers
(28 layers, hidden 1536, intermediate 8960, 12 query heads and 2 KV heads of 128), float32,
saved with safetensors: 4.6 MB. Each cloud is a real protocol server in a subprocess on
127.0.0.1: moto (S3), Azurite (Azure Blob, installed from npm into ~/.cache/asyncgrpo/emulators on first use),
fake-gcs-server (GCS). Loopback, not a network: the figures are our overhead plus the
emulator's, not WAN latency. GCS publish is not measured: fake-gcs-server refuses the XML API
writes obstore makes, so the bench seeds each GCS version through the emulator's JSON API and
times the fetch only.

Run: ``python bench/transport.py [--rounds 20] [--warmup 2] [--backends local,s3,azure,gcs]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

# ---- defaults -------------------------------------------------------------------------------
ROUNDS, WARMUP, RANK = 20, 2, 1
BACKENDS = "local,s3,azure,gcs"
CONTAINER = "bench-bucket"
LAYERS, HIDDEN, INTERMEDIATE, KV_DIM = 28, 1536, 8960, 2 * 128
SHAPES = {  # module: (in_features, out_features)
    "self_attn.q_proj": (HIDDEN, HIDDEN),
    "self_attn.k_proj": (HIDDEN, KV_DIM),
    "self_attn.v_proj": (HIDDEN, KV_DIM),
    "self_attn.o_proj": (HIDDEN, HIDDEN),
    "mlp.gate_proj": (HIDDEN, INTERMEDIATE),
    "mlp.up_proj": (HIDDEN, INTERMEDIATE),
    "mlp.down_proj": (INTERMEDIATE, HIDDEN),
}


def write_adapter(path: Path, rank: int) -> int:
    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    tensors = {}
    for layer in range(LAYERS):
        for module, (fan_in, fan_out) in SHAPES.items():
            base = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{base}.lora_A.weight"] = rng.standard_normal((rank, fan_in), np.float32)
            tensors[f"{base}.lora_B.weight"] = rng.standard_normal((fan_out, rank), np.float32)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2,
        "target_modules": [m.split(".")[1] for m in SHAPES],
        "base_model_name_or_path": "Qwen/Qwen2.5-1.5B",
    }
    (path / "adapter_config.json").write_text(json.dumps(config))
    return sum(p.stat().st_size for p in path.iterdir())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_moto() -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1).read()
            break
        except OSError:
            time.sleep(0.05)
    req = urllib.request.Request(f"{endpoint}/bench-bucket", method="PUT")
    urllib.request.urlopen(req, timeout=5).read()
    return proc, endpoint


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def run(args: argparse.Namespace) -> None:
    from asyncgrpo.store.adapters import AdapterStore
    from asyncgrpo.testing.emulators import azurite, fake_gcs_server, seed_fake_gcs
    from asyncgrpo.transport.azure import AzureBlobTransport
    from asyncgrpo.transport.gcs import GCSTransport
    from asyncgrpo.transport.local import LocalTransport
    from asyncgrpo.transport.s3 import S3Transport

    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    work = Path(tempfile.mkdtemp(prefix="bench-transport-"))
    with contextlib.ExitStack() as servers:
        src = work / "adapter"
        size = write_adapter(src, args.rank)
        results: dict[str, list[float]] = {}

        def record(name: str, seconds: float, i: int) -> None:
            if i >= args.warmup:
                results.setdefault(name, []).append(seconds * 1e3)

        total = args.rounds + args.warmup
        for i in range(total):  # plain copy of the same bytes, the floor
            t = time.perf_counter()
            shutil.copytree(src, work / "copies" / f"c{i}")
            record("file copy (shutil.copytree)", time.perf_counter() - t, i)

        variants = []
        if "local" in backends:
            variants.append(("local", LocalTransport(work / "store")))
        if "s3" in backends:
            proc, endpoint = start_moto()
            servers.callback(lambda: (proc.terminate(), proc.wait(10)))
            s3 = S3Transport(
                CONTAINER,
                "bench",
                endpoint=endpoint,
                region="us-east-1",
                access_key_id="bench",
                secret_access_key="bench",
            )
            variants.append(("s3 (moto)", s3))
        if "azure" in backends:
            conn = servers.enter_context(azurite(CONTAINER))
            variants.append(
                ("azure (azurite)", AzureBlobTransport(CONTAINER, "bench", connection_string=conn))
            )
        for label, transport in variants:
            store = AdapterStore(transport)
            for i in range(total):
                t = time.perf_counter()
                await store.publish("bench", i, src, step=i)
                record(f"{label}: publish", time.perf_counter() - t, i)
                t = time.perf_counter()
                await store.fetch("bench", i, work / f"cache-{label}")
                record(f"{label}: fetch (verify sha256)", time.perf_counter() - t, i)
        if "gcs" in backends:
            base_url = servers.enter_context(fake_gcs_server(CONTAINER))
            staging = LocalTransport(work / "gcs-staging")
            await AdapterStore(staging).publish("bench", 0, src)
            files = {info.key: await staging.get(info.key) async for info in staging.list("")}
            store = AdapterStore(GCSTransport(CONTAINER, "bench", base_url=base_url))
            for i in range(total):  # same bytes under a new version number each round
                for key, data in files.items():
                    versioned = key.replace("/v0/", f"/v{i}/", 1)
                    seed_fake_gcs(base_url, CONTAINER, f"bench/{versioned}", data)
                t = time.perf_counter()
                await store.fetch("bench", i, work / "cache-gcs")
                record("gcs (fake-gcs-server): fetch (verify sha256)", time.perf_counter() - t, i)

        print(
            f"adapter: Qwen2.5-1.5B LoRA r={args.rank} all-linear, {LAYERS} layers, "
            f"{size / 1e6:.2f} MB in 2 files; {args.rounds} rounds after {args.warmup} warm-up"
        )
        print(f"{'variant':<46} {'p50 ms':>8} {'p95 ms':>8} {'MB/s @p50':>10}")
        for name, ms in results.items():
            p50 = statistics.median(ms)
            print(f"{name:<46} {p50:>8.1f} {pct(ms, 0.95):>8.1f} {size / 1e3 / p50:>10.0f}")
    shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=ROUNDS)
    ap.add_argument("--warmup", type=int, default=WARMUP)
    ap.add_argument("--rank", type=int, default=RANK)
    ap.add_argument("--backends", default=BACKENDS, help="comma-separated: local,s3,azure,gcs")
    asyncio.run(run(ap.parse_args()))


if __name__ == "__main__":
    main()
