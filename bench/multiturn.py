"""Multi-turn rollouts, side by side in one run.

(a) ``--part cache``: prefix reuse of multi-turn episodes through the proxy, round-robin vs
    prefix affinity without and with the episodes' ``X-Session-ID``, on two real vLLM CPU
    replicas of the tiny model. Each episode is ``--turns`` model turns with the environment's
    message between them (asyncgrpo.testing.envs.ChatterEnv), so turn k's prompt is turn k-1's
    whole sequence. Reports vLLM's own prefix-cache hit rate (``vllm:prefix_cache_hits_total /
    queries_total`` deltas, caches reset before each run), the proxy's decisions
    (/proxy/stats), and the share of turns after the first that landed on the replica that served the episode's previous turn (the proxy's
    ``X-Asyncgrpo-Replica``).
(b) ``--part learn``: the calculator tool environment (examples/tool_calculator.yaml) trained
    with ``run_training`` for each of ``--seeds``: reward over the first and last steps.
(c) ``--part verifiers``: the calculator task as a verifiers 0.1.10 ``ToolEnv`` (in process,
    asyncgrpo.testing.vf_calculator) and as a verifiers 0.4 taskset (examples/envs/
    vf_v1_calculator, in its own venv: ``--vf4-python``, .venv-vf4 by default), the latter under
    verifiers' null harness played in process (asyncgrpo-chat) and as the null harness's
    program started per episode, played through
    the proxy (affinity + sessions) under one adapter version: episodes/s after the first group
    (which pays for starting the environment process), vLLM's prefix-cache hit rate, model
    turns per episode, groups lost.

    python bench/multiturn.py --part cache [--prompts 32] [--g 8] [--turns 4] [--rounds 2]
    python bench/multiturn.py --part learn [--seeds 0 1 2] [--steps 30]
    python bench/multiturn.py --part verifiers [--prompts 16] [--g 4] [--rounds 2]
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import anyio

from asyncgrpo.rollout import GenerationConfig, RolloutConfig
from asyncgrpo.rollout.client import RolloutClient
from asyncgrpo.rollout.dataset import Prompt, PromptDataset, load_tokenizer
from asyncgrpo.rollout.environment import Episode, load_environment
from asyncgrpo.rollout.policy import PolicyClient
from asyncgrpo.testing.envs import ChatterEnv, calculator_tasks
from asyncgrpo.testing.vllm_metrics import prefix_cache

# ---- defaults -------------------------------------------------------------------------------
PROMPTS, G, TURNS, TOKENS, INFLIGHT, ROUNDS = 32, 8, 4, 24, 64, 2
SEEDS, STEPS = (0, 1, 2), 30
WORDS = "cat dog bird fish red blue green sun moon star tree road house river stone".split()
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tool_calculator.yaml"
VF4_PYTHON = Path(__file__).resolve().parents[1] / ".venv-vf4" / "bin" / "python"
VF4_PACKAGE = Path(__file__).resolve().parents[1] / "examples" / "envs" / "vf_v1_calculator"


class _Tracked(ChatterEnv):
    """ChatterEnv that keeps each episode's replicas, turn by turn; ``sessions=False`` sends no
    ``X-Session-ID`` (the proxy then routes by prefixes alone)."""

    def __init__(self, *, sessions: bool = True, **kw: Any) -> None:
        super().__init__(**kw)
        self.sessions = sessions
        self.replicas: list[list[str | None]] = []

    def session(self, task: Prompt) -> str | None:
        return super().session(task) if self.sessions else None

    async def group(self, task: Prompt, policy: PolicyClient, g: int) -> list[Episode]:
        episodes = await super().group(task, policy, g)
        self.replicas += [e.replicas or [] for e in episodes]
        return episodes


def prompts(n: int) -> list[list[dict[str, str]]]:
    """Chat prompts, each with its own ~150 words (a full CPU KV block of its own and more)."""
    return [
        [{"role": "user", "content": " ".join(WORDS[(i * 7 + j * 3) % 15] for j in range(150))}]
        for i in range(n)
    ]


#: The routings compared: the proxy's policy, and whether episodes send ``X-Session-ID``.
ROUTINGS = {
    "round_robin": ("round_robin", True),
    "prefix only": ("affinity", False),
    "affinity + session": ("affinity", True),
}


async def run_cache(urls: list[str], model: str, routing: str, args: argparse.Namespace) -> dict:
    from asyncgrpo.proxy import ProxyConfig, serve_proxy

    policy, sessions = ROUTINGS[routing]
    tok = load_tokenizer(model)
    gen = GenerationConfig(num_generations=args.g, max_completion_length=args.tokens)
    env = _Tracked(
        tokenizer=tok,
        generation=gen,
        max_turns=args.turns,
        max_episode_tokens=1024,
        sessions=sessions,
    )
    async with aiohttp.ClientSession() as s:
        for url in urls:
            async with s.post(url + "/reset_prefix_cache") as r:
                assert r.status == 200, await r.text()
    h0, q0 = await prefix_cache(urls)
    proxy = ProxyConfig(upstreams=tuple(urls), port=0, routing=policy)  # type: ignore[arg-type]
    async with serve_proxy(proxy) as base:
        client = RolloutClient(
            base_url=base,
            dataset=PromptDataset(prompts(args.prompts), tokenizer=tok, shuffle=False),
            generation=gen,
            rollout=RolloutConfig(max_inflight=args.inflight, queue_maxsize=4096),
            policy=(model, 0),
            environment=env,
        )
        t0 = time.perf_counter()
        async with client:
            samples = await client.get(args.prompts * args.g)
        wall = time.perf_counter() - t0
        async with aiohttp.ClientSession() as s, s.get(base + "/proxy/stats") as r:
            stats = await r.json()
    h1, q1 = await prefix_cache(urls)
    follow = [a == b for reps in env.replicas for a, b in itertools.pairwise(reps)]
    return {
        "wall_s": wall,
        "episodes": len(samples),
        "turns": sum(len(r) for r in env.replicas),
        "hit_rate": (h1 - h0) / max(q1 - q0, 1.0),
        "same_replica": sum(follow) / max(len(follow), 1),
        **stats["fractions"],
    }


async def part_cache(args: argparse.Namespace) -> None:
    from asyncgrpo.serve import launch_replicas
    from asyncgrpo.testing import make_tiny_model, tiny_serve_config

    with tempfile.TemporaryDirectory() as tmp:
        model = str(make_tiny_model(Path(tmp) / "model", seed=0))
        serve = tiny_serve_config(model, replicas=2, max_model_len=1024)
        async with launch_replicas(serve) as replicas:
            urls = [r.url for r in replicas]
            warm = argparse.Namespace(**{**vars(args), "prompts": 4})
            await run_cache(urls, model, "round_robin", warm)
            runs: dict[str, list[dict]] = {routing: [] for routing in ROUTINGS}
            for _ in range(args.rounds):
                for routing in runs:  # interleaved, so drift hits both alike
                    runs[routing].append(await run_cache(urls, model, routing, args))
    print(
        f"\n2 replicas, {args.prompts} prompts x G={args.g} episodes of {args.turns} model turns "
        f"(<= {args.tokens} tokens each), max_inflight {args.inflight}, median of "
        f"{args.rounds} rounds\n"
    )
    print(
        "| routing | vLLM prefix-cache hit rate | turns on the previous turn's replica | "
        "session | affinity | unmatched | spill | wall s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for routing, rs in runs.items():
        med = {k: statistics.median(r.get(k, 0.0) for r in rs) for k in rs[0]}
        print(
            f"| {routing} | {med['hit_rate']:.3f} | {med['same_replica']:.3f} | "
            f"{med.get('session', 0):.3f} | {med.get('affinity', 0):.3f} | "
            f"{med.get('unmatched', 0):.3f} | "
            f"{med.get('spill', 0):.3f} | {med['wall_s']:.1f} |"
        )


async def part_learn(args: argparse.Namespace) -> None:
    """One pair of replicas for every seed (each run reaches them as ``proxy.upstreams`` and
    has them fetch its adapter versions from its own transport)."""
    from asyncgrpo.config.training import TrainingConfig
    from asyncgrpo.run.metrics import read_metrics, summarize
    from asyncgrpo.run.training import run_training
    from asyncgrpo.serve import launch_replicas
    from asyncgrpo.testing import make_tiny_model, tiny_serve_config

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "model", seed=0)
        serve = tiny_serve_config(
            model,
            replicas=2,
            max_model_len=512,
            transports=(tmp,),
            adapter_cache_dir=str(Path(tmp) / "replica-cache"),
        )
        async with launch_replicas(serve) as replicas:
            urls = ",".join(r.url for r in replicas)
            for seed in args.seeds:
                overrides = [f"model={model}", f"output_dir={tmp}", f"run_name=calc-{seed}",
                             f"seed={seed}", f"dataset.seed={seed}", "serve.replicas=0",
                             f"proxy.upstreams=[{urls}]", f"trainer.max_steps={args.steps}"]  # fmt: skip
                cfg = TrainingConfig.from_yaml(EXAMPLE, overrides=overrides)
                t0 = time.perf_counter()
                result = await run_training(cfg)
                records = read_metrics(result.run_dir)
                first, last = summarize(records, "reward")
                tool_first, tool_last = summarize(records, "rewards/tool_call")
                ratios = [r["ratio"] for r in records if "ratio" in r]
                rows.append((seed, first, last, tool_first, tool_last, min(ratios), max(ratios),
                             time.perf_counter() - t0))  # fmt: skip
    print(
        f"\ncalculator tool environment, tiny model, {args.steps} steps per seed; means of the "
        "first and last 5 steps\n"
    )
    print(
        "| seed | reward first 5 | reward last 5 | tool_call first 5 | tool_call last 5 | "
        "ratio min | ratio max | wall s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for seed, f, la, tf, tl, rmin, rmax, wall in rows:
        print(
            f"| {seed} | {f:.3f} | {la:.3f} | {tf:.3f} | {tl:.3f} | {rmin:.4f} | {rmax:.4f} | "
            f"{wall:.0f} |"
        )


def verifiers_envs(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The environments compared: the same task, rewards and turn bound; the v1 taskset under
    verifiers' null harness in process (asyncgrpo-chat) and as its program per episode."""

    def v1(harness: str) -> dict[str, Any]:
        local = {
            "agent": {
                "harness": {"id": harness},
                "runtime": {"type": "subprocess"},
                "max_turns": args.turns,
            }
        }
        return {"verifiers": "vf-v1-calculator", "args": local, "python": args.vf4_python}

    return {
        "verifiers 0.1.10 ToolEnv, in process": {
            "verifiers": "asyncgrpo.testing.vf_calculator",
            "args": {"kind": "tool", "max_turns": args.turns},
        },
        "verifiers 0.4 taskset, own venv, asyncgrpo-chat harness": v1("asyncgrpo-chat"),
        "verifiers 0.4 taskset, own venv, null harness (a program per episode)": v1("null"),
    }


async def run_verifiers(urls: list[str], model: str, name: str, args: argparse.Namespace) -> dict:
    from asyncgrpo.proxy import ProxyConfig, serve_proxy

    tok = load_tokenizer(model)
    gen = GenerationConfig(num_generations=args.g, max_completion_length=args.tokens)
    env = load_environment(
        verifiers_envs(args)[name], {"max_episode_tokens": 512}, tokenizer=tok, generation=gen
    )
    async with aiohttp.ClientSession() as s:
        for url in urls:
            async with s.post(url + "/reset_prefix_cache") as r:
                assert r.status == 200, await r.text()
    h0, q0 = await prefix_cache(urls)
    async with serve_proxy(ProxyConfig(upstreams=tuple(urls), port=0)) as base:
        client = RolloutClient(
            base_url=base,
            dataset=PromptDataset(calculator_tasks(args.prompts), tokenizer=tok, shuffle=False),
            generation=gen,
            rollout=RolloutConfig(max_inflight=args.inflight, queue_maxsize=4096),
            policy=(model, 0),
            environment=env,
        )
        t0 = time.perf_counter()
        async with client:
            samples = await client.get(args.g)  # start-up (an environment process) and a group
            t1 = time.perf_counter()
            samples += await client.get((args.prompts - 1) * args.g)
            stats = client.stats()
        wall = time.perf_counter() - t0
    h1, q1 = await prefix_cache(urls)
    turns = [
        sum(m and (i == 0 or not s.policy_mask()[i - 1]) for i, m in enumerate(s.policy_mask()))
        for s in samples
    ]
    return {
        "wall_s": wall,
        "first_group_s": t1 - t0,
        "episodes_per_s": max(len(samples) - args.g, 0) / max(wall - (t1 - t0), 1e-9),
        "hit_rate": (h1 - h0) / max(q1 - q0, 1.0),
        "turns": statistics.mean(turns) if turns else 0.0,
        "lost": stats.get("rollout/env_failures_total", 0.0),
    }


async def part_verifiers(args: argparse.Namespace) -> None:
    from asyncgrpo.serve import launch_replicas
    from asyncgrpo.testing import make_tiny_model, tiny_serve_config

    # the example package, for the environment process (and the tool servers it starts)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(VF4_PACKAGE), os.environ.get("PYTHONPATH")) if p
    )
    names = list(verifiers_envs(args))
    with tempfile.TemporaryDirectory() as tmp:
        model = str(make_tiny_model(Path(tmp) / "model", seed=0))
        serve = tiny_serve_config(model, replicas=2, max_model_len=1024)
        async with launch_replicas(serve) as replicas:
            urls = [r.url for r in replicas]
            warm = argparse.Namespace(**{**vars(args), "prompts": 2})
            for name in names:
                await run_verifiers(urls, model, name, warm)
            runs: dict[str, list[dict]] = {name: [] for name in names}
            for _ in range(args.rounds):
                for name in names:  # interleaved, so drift hits both alike
                    runs[name].append(await run_verifiers(urls, model, name, args))
    print(
        f"\n2 replicas, {args.prompts} calculator tasks x G={args.g} episodes of <= {args.turns} "
        f"model turns (<= {args.tokens} tokens each), max_inflight {args.inflight}, median of "
        f"{args.rounds} rounds\n"
    )
    print(
        "| environment | episodes/s after the first group | first group s | vLLM prefix-cache "
        "hit rate | model turns per episode | groups lost | wall s |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        print(
            f"| {name} | {med['episodes_per_s']:.2f} | {med['first_group_s']:.1f} | "
            f"{med['hit_rate']:.3f} | "
            f"{med['turns']:.2f} | {med['lost']:.0f} | {med['wall_s']:.1f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--part", choices=["cache", "learn", "verifiers"], required=True)
    parser.add_argument("--prompts", type=int, default=PROMPTS)
    parser.add_argument("--g", type=int, default=G)
    parser.add_argument("--turns", type=int, default=TURNS)
    parser.add_argument("--tokens", type=int, default=TOKENS)
    parser.add_argument("--inflight", type=int, default=INFLIGHT)
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--vf4-python", default=str(VF4_PYTHON))
    args = parser.parse_args()
    parts = {"cache": part_cache, "learn": part_learn, "verifiers": part_verifiers}
    anyio.run(parts[args.part], args)


if __name__ == "__main__":
    main()
