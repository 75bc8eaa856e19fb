"""Rollout client throughput side by side: one request with n=G vs G requests with n=1.

Starts two float32 vLLM replicas of the tiny model (or uses ``--urls``) behind an in-process
proxy (as ``run_training`` does), warms them up, then runs the same prompts through
``RolloutClient`` in each request mode via the proxy, and prints wall time, completions/s and
tokens/s.

Run: ``python bench/rollout.py [--prompts 64] [--g 8] [--tokens 64] [--inflight 64]
[--rounds 2] [--urls URL ...]``.
"""

from __future__ import annotations

import argparse
import statistics
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

        results: dict[str, list[dict[str, float]]] = {"n": [], "per_sample": []}
        for _ in range(args.rounds):
            for mode in results:  # interleaved, so drift hits both modes alike
                results[mode].append(await run_mode(url, model, tok, mode, args))

    print(
        f"\n{len(urls)} replicas behind the proxy, {args.prompts} prompts x G={args.g}, <= {args.tokens} new "
        f"tokens, max_inflight {args.inflight}, median of {args.rounds} rounds\n"
    )
    print("| request mode | wall s | completions/s | generated tok/s | score_block s |")
    print("|---|---|---|---|---|")
    for mode, runs in results.items():
        wall = statistics.median(x["wall_s"] for x in runs)
        comp = statistics.median(x["completions"] / x["wall_s"] for x in runs)
        tps = statistics.median(x["tokens"] / x["wall_s"] for x in runs)
        sb = statistics.median(x["rollout/score_block_total_s"] for x in runs)
        label = "n=G, 1 request" if mode == "n" else "n=1, G requests"
        print(f"| {label} | {wall:.2f} | {comp:.0f} | {tps:.0f} | {sb:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompts", type=int, default=PROMPTS)
    parser.add_argument("--g", type=int, default=G)
    parser.add_argument("--tokens", type=int, default=TOKENS)
    parser.add_argument("--inflight", type=int, default=INFLIGHT)
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--urls", nargs="*", help="existing replicas (default: start two)")
    anyio.run(bench, parser.parse_args())


if __name__ == "__main__":
    main()
