"""Rollout client throughput side by side: one request with n=G vs G requests with n=1.

Starts two float32 vLLM replicas of the tiny model (or uses ``--urls``) behind an in-process
proxy (as ``run_training`` does), warms them up, then runs the same prompts through
``RolloutClient`` in each request mode via the proxy, and prints wall time, completions/s and
tokens/s.

Run: ``python bench/rollout.py [--prompts 64] [--g 8] [--tokens 64] [--inflight 64]
[--rounds 2] [--urls URL ...] [--baseline DIR ...]``.

``--baseline DIR`` (repeatable; e.g. an archive of main: ``git archive main | tar -x -C DIR``)
measures that checkout's rollout client too, side by side on the same replicas: every variant,
this tree included, then runs in its own subprocess with ``PYTHONPATH`` set to its checkout,
rounds interleaved over variants and modes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

from asyncgrpo.rollout import GenerationConfig, RolloutConfig
from asyncgrpo.rollout.client import RolloutClient
from asyncgrpo.rollout.dataset import PromptDataset, load_tokenizer
from asyncgrpo.rollout.rewards import RewardScorer

# ---- defaults -------------------------------------------------------------------------------
PROMPTS, G, TOKENS, INFLIGHT, ROUNDS = 64, 8, 64, 64, 2
WORDS = "cat dog bird fish red blue green sun moon star tree road house river stone".split()


def length_reward(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
    return [float(len(ids)) for ids in kwargs["completion_ids"]]


def prompts(n: int) -> list[list[dict[str, str]]]:
    """Chat prompts sharing the template, each with its own ~40 words (one CPU KV block+)."""
    return [
        [{"role": "user", "content": " ".join(WORDS[(i * 7 + j * 3) % 15] for j in range(40))}]
        for i in range(n)
    ]


async def run_mode(
    url: str, model: str, tok: Any, mode: str, args: argparse.Namespace
) -> dict[str, float]:
    dataset = PromptDataset(prompts(args.prompts), tokenizer=tok, shuffle=False)
    client = RolloutClient(
        base_url=url,
        dataset=dataset,
        generation=GenerationConfig(
            num_generations=args.g,
            max_completion_length=args.tokens,
            request_mode=mode,  # type: ignore[arg-type]
        ),
        rollout=RolloutConfig(max_inflight=args.inflight, queue_maxsize=args.prompts * args.g),
        scorer=RewardScorer([length_reward]),
        policy=(model, 0),
    )
    t0 = time.perf_counter()
    async with client:
        samples = await client.get(args.prompts * args.g)
        stats = client.stats()
    wall = time.perf_counter() - t0
    tokens = sum(len(s.completion_ids) for s in samples)
    return {"wall_s": wall, "completions": len(samples), "tokens": tokens, **stats}


async def bench(args: argparse.Namespace) -> None:
    if args.urls:
        await run_all(args.urls, args)
        return
    from asyncgrpo.serve import launch_replicas
    from asyncgrpo.testing import make_tiny_model, tiny_serve_config

    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "model", seed=0)
        async with launch_replicas(tiny_serve_config(model, replicas=2)) as replicas:
            await run_all([r.url for r in replicas], args, model=str(model))


def run_variant(
    root: str, url: str, model: str, mode: str, args: argparse.Namespace
) -> dict[str, float]:
    """One measured run of ``mode`` by the rollout client of checkout ``root`` (a subprocess)."""
    argv = [sys.executable, __file__, "--worker", url, model, mode, "--prompts", str(args.prompts),
            "--g", str(args.g), "--tokens", str(args.tokens), "--inflight", str(args.inflight)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.path.abspath(root)}
    out = subprocess.run(argv, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def worker(args: argparse.Namespace) -> None:
    """``--worker URL MODEL MODE``: one run, its figures as a JSON line (the asyncgrpo it
    imports is whichever ``PYTHONPATH`` names)."""
    url, model, mode = args.worker
    result = anyio.run(run_mode, url, model, load_tokenizer(model), mode, args)
    print(json.dumps({k: result[k] for k in ("wall_s", "completions", "tokens")}))


async def run_all(urls: list[str], args: argparse.Namespace, model: str | None = None) -> None:
    import aiohttp

    from asyncgrpo.proxy import ProxyConfig, serve_proxy

    async with serve_proxy(ProxyConfig(upstreams=tuple(urls), port=0)) as url:
        async with aiohttp.ClientSession() as session, session.get(f"{url}/v1/models") as resp:
            served = (await resp.json())["data"]
        model = model or next(m["id"] for m in served if m.get("parent") is None)
        tok = load_tokenizer(model)  # the base model is served under its directory

        # warm-up: first requests on a fresh CPU replica are slow (compilation, allocation)
        warm_up = argparse.Namespace(**{**vars(args), "prompts": 8})
        await run_mode(url, model, tok, "n", warm_up)

        variants = ["this tree", *args.baseline] if args.baseline else [None]
        results: dict[tuple[str | None, str], list[dict[str, float]]] = {
            (v, m): [] for v in variants for m in ("n", "per_sample")
        }
        root = str(Path(__file__).resolve().parents[1])
        for _ in range(args.rounds):
            for variant, mode in results:  # interleaved, so drift hits every variant alike
                if variant is None:
                    run = await run_mode(url, model, tok, mode, args)
                else:
                    checkout = root if variant == "this tree" else variant
                    run = await anyio.to_thread.run_sync(
                        run_variant, checkout, url, model, mode, args
                    )
                results[(variant, mode)].append(run)

    print(
        f"\n{len(urls)} replicas behind the proxy, {args.prompts} prompts x G={args.g}, <= {args.tokens} new "
        f"tokens, max_inflight {args.inflight}, median of {args.rounds} rounds\n"
    )
    print(
        "| client | request mode | wall s | wall s, each round | completions/s | generated tok/s |"
    )
    print("|---|---|---|---|---|---|")
    for (variant, mode), runs in results.items():
        wall = statistics.median(x["wall_s"] for x in runs)
        comp = statistics.median(x["completions"] / x["wall_s"] for x in runs)
        tps = statistics.median(x["tokens"] / x["wall_s"] for x in runs)
        label = "n=G, 1 request" if mode == "n" else "n=1, G requests"
        each = " ".join(f"{x['wall_s']:.1f}" for x in runs)
        print(
            f"| {variant or 'this tree'} | {label} | {wall:.2f} | {each} | {comp:.0f} | {tps:.0f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompts", type=int, default=PROMPTS)
    parser.add_argument("--g", type=int, default=G)
    parser.add_argument("--tokens", type=int, default=TOKENS)
    parser.add_argument("--inflight", type=int, default=INFLIGHT)
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--urls", nargs="*", help="existing replicas (default: start two)")
    parser.add_argument(
        "--baseline", action="append", help="another checkout's rollout client, side by side"
    )
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
    else:
        anyio.run(bench, args)


if __name__ == "__main__":
    main()
