"""A pair of vLLM replicas, side by side in one run: vLLM's default processes against the engine
core running the model itself (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as the tests run them).

On CPU vLLM starts three Python processes per replica, each importing vLLM and torch: the API
server, the engine core and its worker. With multiprocessing off for the engine's workers the
engine core runs the model itself, and vLLM's thread binding (which it applies in the worker
process only) never happens: the engine core keeps an OpenMP thread per core.
``ServeConfig.env`` gives it the thread count of its bound core instead. The third variant
leaves it at the cores' count (``OMP_NUM_THREADS`` set to it), as vLLM alone would.

Each round starts the tests' shared pair (two float32 replicas of the tiny model, a core each)
per variant in turn and measures: seconds from spawn to both ``/health`` answering; a load
phase of 8 concurrent requests for 8 completions of 48 tokens on each replica while this
process multiplies matrices in a thread (a trainer's share of the cores), its seconds and the
trainer's multiplications per second; the processes per replica; and whether a fixed greedy
completion's logprobs equal the default's to the bit (they must).

Run: ``python bench/replica_start.py [--rounds 2]`` (about two minutes per round).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import anyio
import psutil
import torch

from asyncgrpo.serve import launch_replicas
from asyncgrpo.testing import make_tiny_model, tiny_serve_config
from asyncgrpo.vllm.client import VLLMClient

SWITCH = "VLLM_ENABLE_V1_MULTIPROCESSING"
VARIANTS: dict[str, dict[str, str]] = {
    "default (3 processes)": {SWITCH: "1"},
    "engine runs the model": {SWITCH: "0"},
    "  ... OpenMP unbound": {SWITCH: "0", "OMP_NUM_THREADS": str(len(os.sched_getaffinity(0)))},
}


class Trainer(threading.Thread):
    """Matrix multiplications until stopped: the trainer computing beside the replicas."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.done = 0
        self.stop = threading.Event()

    def run(self) -> None:
        a = torch.randn(256, 256)
        while not self.stop.is_set():
            a = torch.tanh(a @ a)
            self.done += 1


async def _load(client: VLLMClient, base: str) -> None:
    async with anyio.create_task_group() as tg:
        for i in range(8):
            request = {
                "model": base,
                "prompt": [5, 6, 7 + i],
                "max_tokens": 48,
                "n": 8,
                "temperature": 1.0,
                "ignore_eos": True,
            }
            tg.start_soon(client.completions, request)


async def pair_once(
    model: Path, logs: Path, env: dict[str, str]
) -> tuple[float, float, float, int, list]:
    """(seconds to healthy, load seconds, trainer steps/s, processes per replica, logprobs)."""
    saved = {name: os.environ.get(name) for name in (SWITCH, "OMP_NUM_THREADS")}
    os.environ.pop("OMP_NUM_THREADS", None)
    os.environ.update(env)
    try:
        spawned = time.monotonic()
        config = tiny_serve_config(model, replicas=2, log_dir=str(logs))
        async with launch_replicas(config) as replicas:
            healthy = time.monotonic() - spawned
            processes = 1 + len(psutil.Process(replicas[0].pid).children(recursive=True))
            clients = [VLLMClient(r.url) for r in replicas]
            try:
                base = (await clients[0].models())[0]
                greedy = await clients[0].completions(
                    {
                        "model": base,
                        "prompt": [5, 6, 7],
                        "max_tokens": 8,
                        "temperature": 0,
                        "logprobs": 0,
                    }
                )
                trainer = Trainer()
                trainer.start()
                t0 = time.monotonic()
                async with anyio.create_task_group() as tg:
                    for client in clients:
                        tg.start_soon(_load, client, base)
                load = time.monotonic() - t0
                trainer.stop.set()
                trainer.join()
            finally:
                for client in clients:
                    await client.aclose()
        return (
            healthy,
            load,
            trainer.done / load,
            processes,
            greedy["choices"][0]["logprobs"]["token_logprobs"],
        )
    finally:
        for name, value in saved.items():
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value


async def main(rounds: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "model", seed=0)
        runs: dict[str, list[tuple[float, float, float, int, list]]] = {v: [] for v in VARIANTS}
        for r in range(rounds):
            for name, env in VARIANTS.items():
                runs[name].append(await pair_once(model, Path(tmp) / f"logs-{r}", env))
                healthy, load = runs[name][-1][:2]
                print(
                    f"round {r + 1}: {name.strip()}: healthy after {healthy:.1f} s, load {load:.1f} s",
                    file=sys.stderr,
                )
    reference = runs[next(iter(VARIANTS))][0][4]
    print(
        f"\n{'variant':<24}{'pair healthy s (mean, min-max)':>32}{'load s':>9}{'trainer steps/s':>17}"
        f"{'processes':>11}  same logprobs"
    )
    for name, results in runs.items():
        healthy = [h for h, *_ in results]
        load = statistics.fmean(x[1] for x in results)
        steps = statistics.fmean(x[2] for x in results)
        same = all(x[4] == reference for x in results)
        print(
            f"{name:<24}{statistics.fmean(healthy):>17.1f} ({min(healthy):.1f}-{max(healthy):.1f})"
            f"{load:>9.1f}{steps:>17.0f}{results[0][3]:>11}  {same}"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    anyio.run(main, parser.parse_args().rounds)
