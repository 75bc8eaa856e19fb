"""A vLLM replica's start, side by side in one run: vLLM's default processes against the engine
core running its model itself (``VLLM_ENABLE_V1_MULTIPROCESSING=0``; docs/testing.md says why
the tests do not set it yet).

On CPU vLLM starts three Python processes per replica, each importing vLLM and torch: the API
server, the engine core and its worker. With multiprocessing off for the engine's workers the
engine core runs the model itself. The variants take turns, one replica of the tiny float32
model at a time: seconds from spawn to ``/health`` answering, the first completion's seconds,
the replica's processes (the idle parent-death watchdog counted), and whether the logprobs of a
fixed completion are the same to the bit (they must be).

Run: ``python bench/replica_start.py [--rounds 3]`` (about a minute per round).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import anyio
import psutil

from asyncgrpo.serve import launch_replicas
from asyncgrpo.testing import make_tiny_model, tiny_serve_config
from asyncgrpo.vllm.client import VLLMClient

VARIANTS = {"default (3 processes)": None, "engine runs the model": "0"}
SWITCH = "VLLM_ENABLE_V1_MULTIPROCESSING"


async def start_once(model: Path, logs: Path, value: str | None) -> tuple[float, float, int, list]:
    """(seconds to healthy, seconds of the first completion, processes, its logprobs)."""
    saved = os.environ.pop(SWITCH, None)
    if value is not None:
        os.environ[SWITCH] = value
    try:
        spawned = time.monotonic()
        async with launch_replicas(tiny_serve_config(model, log_dir=str(logs))) as (replica,):
            healthy = time.monotonic() - spawned
            processes = 1 + len(psutil.Process(replica.pid).children(recursive=True))
            async with VLLMClient(replica.url) as client:
                base = (await client.models())[0]
                t0 = time.monotonic()
                body = await client.completions(
                    {
                        "model": base,
                        "prompt": [5, 6, 7],
                        "max_tokens": 8,
                        "temperature": 0,
                        "logprobs": 0,
                    }
                )
                first = time.monotonic() - t0
        return healthy, first, processes, body["choices"][0]["logprobs"]["token_logprobs"]
    finally:
        os.environ.pop(SWITCH, None)
        if saved is not None:
            os.environ[SWITCH] = saved


async def main(rounds: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "model", seed=0)
        runs: dict[str, list[tuple[float, float, int, list]]] = {v: [] for v in VARIANTS}
        for r in range(rounds):
            for name, value in VARIANTS.items():
                runs[name].append(await start_once(model, Path(tmp) / f"logs-{r}", value))
                print(
                    f"round {r + 1}: {name}: healthy after {runs[name][-1][0]:.1f} s",
                    file=sys.stderr,
                )
    reference = runs[next(iter(VARIANTS))][0][3]
    print(
        f"\n{'variant':<24}{'healthy s (mean, min-max)':>28}{'first completion s':>21}"
        f"{'processes':>11}  same logprobs"
    )
    for name, results in runs.items():
        healthy = [h for h, _, _, _ in results]
        first = statistics.fmean(f for _, f, _, _ in results)
        same = all(lp == reference for _, _, _, lp in results)
        print(
            f"{name:<24}{statistics.fmean(healthy):>13.1f} ({min(healthy):.1f}-{max(healthy):.1f})"
            f"{first:>21.1f}{results[0][2]:>11}  {same}"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    anyio.run(main, parser.parse_args().rounds)
