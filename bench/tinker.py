"""The cost of the Tinker API on the training side, side by side in one run.

Four variants take one optimizer step over the same GRPO-shaped synthetic samples (groups
of G sharing a prompt) on the tiny model:

- ``native``: ``Trainer.step`` (packed rows, the GRPO loss), as ``asyncgrpo train`` runs it;
- ``engine``: the service's engine called directly (the request's datums packed into
  token-budget rows, ``importance_sampling``, then AdamW), no HTTP;
- ``per-datum``: the same engine sent one datum per request, so one forward per datum (what
  every request cost before the engine packed), then AdamW;
- ``sdk``: the same through the ``tinker`` SDK against the service on loopback
  (``forward_backward`` + ``optim_step``, protobuf bodies, futures polled).

``sdk`` minus ``engine`` is what the API costs; ``engine`` minus ``native`` what the engine
costs beside the trainer's step on the same packed rows; ``per-datum`` minus ``engine`` what
packing saves. Variants are interleaved, one step each per round; the median (and min) of the
rounds after a warm-up round.

``--sampling`` adds the sampling side (two float32 vLLM replicas of the tiny model behind the
proxy, started here): requests/s of the same ``sample`` calls (one prompt, ``n`` samples each,
``--concurrency`` in flight) through the service and the SDK, and sent to the proxy directly as
vLLM completions, interleaved in rounds.

``--loop`` adds the whole RL step: the native ``run_training`` loop on the demo's recipe
(``examples/tiny_cpu.yaml``: digits reward, 4 prompts x 8 samples, lr 3e-2, rank 1) against
the same recipe driven through the SDK (``examples/tinker_rl_loop.py``'s loop: tinker-cookbook's
``rl_loop`` shape with its default loss, ``stable_reinforce``, sampling with
``record_stability_info`` and datums with provenance; timed part by part), one after the other on the same two vLLM replicas started here. Per step, median over
the steps after the first: s/step and its parts: forward_backward (native ``perf/fwd_bwd_s``),
optim_step (native ``perf/train_step_s`` minus that: packing and the update), publish+load
(native ``perf/weight_sync_s``; SDK ``save_weights_and_get_sampling_client``), sample (native
``perf/rollout_wait_s``, the wait for samples generated while it trained; SDK the ``sample``
futures).

Run: ``python bench/tinker.py [--samples 32] [--rounds 5] [--sampling] [--loop [--steps 20]]``.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script, this file's directory comes first on sys.path and this file would shadow
# the tinker SDK it benchmarks (`import tinker`).
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)

import argparse
import dataclasses
import math
import os
import statistics
import tempfile
import time
from types import ModuleType

import numpy as np
from anyio.from_thread import start_blocking_portal

from asyncgrpo.config.trainer import LoraConfig, TrainerConfig
from asyncgrpo.sample import Sample
from asyncgrpo.testing import make_tiny_model
from asyncgrpo.tinker import TinkerConfig, serve_tinker
from asyncgrpo.tinker.engine import AdamStep, Engine, LoraSpec
from asyncgrpo.tinker.wire import FwdBwdRequest, WireDatum
from asyncgrpo.trainer.loop import Trainer

# ---- defaults -------------------------------------------------------------------------------
SAMPLES, G, ROUNDS, PROMPT, COMPLETION, LR = 32, 8, 5, 24, 32, 1e-3


def make_samples(n: int, g: int, vocab: int) -> list[Sample]:
    rng = np.random.default_rng(0)
    out = []
    for k in range(0, n, g):
        prompt = rng.integers(0, vocab, PROMPT).tolist()
        for _ in range(g):
            out.append(
                Sample(
                    prompt_ids=prompt,
                    completion_ids=rng.integers(0, vocab, COMPLETION).tolist(),
                    logprobs=(-rng.uniform(4, 7, COMPLETION)).tolist(),
                    reward=0.0,
                    advantage=float(rng.uniform(-1, 1)),
                    version=0,
                    group_id=f"g{k}",
                )
            )
    return out


def arrays(s: Sample) -> tuple[list[int], list[int], list[float], list[float]]:
    """A sample as a Datum's input tokens, targets, sampler logprobs and advantages."""
    full = s.prompt_ids + s.completion_ids
    pad = [0.0] * (len(s.prompt_ids) - 1)
    adv = [s.advantage] * len(s.completion_ids)
    return full[:-1], full[1:], pad + list(s.logprobs), pad + adv


async def _proxy_rate(
    url: str, model: str, prompt: list[int], n: int, calls: int, concurrency: int
) -> float:
    import aiohttp
    import anyio

    body = {"model": model, "prompt": prompt, "n": n, "max_tokens": 16, "temperature": 1.0,
            "logprobs": 0, "return_token_ids": True}  # fmt: skip
    limit = anyio.Semaphore(concurrency)
    async with aiohttp.ClientSession() as http:

        async def one() -> None:
            async with limit, http.post(f"{url}/v1/completions", json=body) as resp:
                resp.raise_for_status()
                await resp.json()

        t0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for _ in range(calls):
                tg.start_soon(one)
        return calls / (time.perf_counter() - t0)


def sampling(model: Path, rounds: int, calls: int = 32, n: int = 4, concurrency: int = 8) -> None:
    """Requests/s of ``sample`` through the service vs the proxy directly."""
    import contextlib

    import tinker
    from tinker import types

    from asyncgrpo.proxy import ProxyConfig, serve_proxy
    from asyncgrpo.serve import launch_replicas
    from asyncgrpo.testing import tiny_serve_config

    prompt = [5, 6, 7, 8, 9, 10, 11, 12]
    with start_blocking_portal() as portal, contextlib.ExitStack() as stack:
        replicas = stack.enter_context(
            portal.wrap_async_context_manager(launch_replicas(tiny_serve_config(model, replicas=2)))
        )
        proxy = stack.enter_context(
            portal.wrap_async_context_manager(
                serve_proxy(ProxyConfig(upstreams=tuple(r.url for r in replicas), port=0))
            )
        )
        config = TinkerConfig(
            model=str(model), port=0, dtype="float32", proxy_url=proxy, work_dir=tempfile.mkdtemp()
        )
        url = stack.enter_context(portal.wrap_async_context_manager(serve_tinker(config)))
        service = tinker.ServiceClient(base_url=url, api_key="tml-bench")
        sampler = service.create_sampling_client(base_model=str(model)).result()
        params = types.SamplingParams(max_tokens=16, temperature=1.0)
        chunk = types.ModelInput.from_ints(prompt)

        def sdk_rate() -> float:
            t0 = time.perf_counter()
            done = 0
            while done < calls:
                batch = [
                    sampler.sample(chunk, n, params) for _ in range(min(concurrency, calls - done))
                ]
                for f in batch:
                    f.result()
                done += len(batch)
            return calls / (time.perf_counter() - t0)

        rates: dict[str, list[float]] = {"proxy": [], "sdk": []}
        for _ in range(rounds + 1):  # the first round warms up
            rates["proxy"].append(
                portal.call(_proxy_rate, proxy, str(model), prompt, n, calls, concurrency)
            )
            rates["sdk"].append(sdk_rate())
        service.close("success").result()
    print(f"\nsample: {calls} calls of n={n}, {concurrency} in flight, 16 tokens, {rounds} rounds")
    print(f"{'path':<8} {'median req/s':>13} {'max req/s':>10}")
    for name, rs in rates.items():
        print(f"{name:<8} {statistics.median(rs[1:]):>13.1f} {max(rs[1:]):>10.1f}")


def _example() -> ModuleType:
    """``examples/tinker_rl_loop.py`` (its reward and datums), imported by path."""
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "examples" / "tinker_rl_loop.py"
    spec = importlib.util.spec_from_file_location("tinker_rl_loop", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _native(model: Path, urls: list[str], out: Path, steps: int) -> list[dict[str, float]]:
    """The demo's recipe through ``run_training`` on the replicas at ``urls``; per-step parts."""
    import anyio

    from asyncgrpo.config.training import TrainingConfig
    from asyncgrpo.run.metrics import read_metrics
    from asyncgrpo.run.training import run_training

    example = Path(__file__).resolve().parent.parent / "examples" / "tiny_cpu.yaml"
    cfg = TrainingConfig.from_yaml(
        example,
        [
            f"model={model}",
            f"output_dir={out}",
            "run_name=native",
            f"trainer.max_steps={steps}",
            "trainer.save_steps=0",
            "serve.replicas=0",
            f"proxy.upstreams=[{','.join(urls)}]",
            "eval=null",
        ],
    )
    result = anyio.run(run_training, cfg)
    rows = []
    for r in read_metrics(result.run_dir):
        if "perf/step_s" not in r:
            continue
        rows.append(
            {
                "step": r["perf/step_s"],
                "forward_backward": r["perf/fwd_bwd_s"],
                "optim_step": r["perf/train_step_s"] - r["perf/fwd_bwd_s"],
                "publish+load": r.get("perf/weight_sync_s", math.nan),
                "sample": r["perf/rollout_wait_s"],
                "reward": r.get("reward", math.nan),
            }
        )
    return rows


def _sdk(base_url: str, model: Path, steps: int) -> list[dict[str, float]]:
    """The same recipe through the SDK (``examples/tinker_rl_loop.py``'s loop, with
    ``rl_loop``'s default loss, ``stable_reinforce``); per-step parts."""
    import tinker
    from tinker import types

    ex = _example()
    groups, group_size, max_tokens = 4, 8, 32  # the demo's 32 samples of up to 32 tokens
    service = tinker.ServiceClient(base_url=base_url, api_key="tml-bench")
    training = service.create_lora_training_client(base_model=str(model), rank=1, seed=0).result()
    tokenizer = training.get_tokenizer()
    adam = types.AdamParams(learning_rate=3e-2, beta1=0.0, beta2=0.95, eps=1e-8)
    rows = []
    for step in range(steps):
        t0 = time.perf_counter()
        sampler = training.save_weights_and_get_sampling_client(record_stability_info=True).result()
        t1 = time.perf_counter()
        texts = [ex.PROMPTS[(step * groups + i) % len(ex.PROMPTS)] for i in range(groups)]
        prompts = [tokenizer.encode(t) for t in texts]
        params = types.SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=step)
        futures = [
            sampler.sample(types.ModelInput.from_ints(p), group_size, params) for p in prompts
        ]
        results = [f.result().sequences for f in futures]
        t2 = time.perf_counter()
        data, rewards = [], []
        for prompt, sequences in zip(prompts, results, strict=True):
            group = [ex.digit_reward(tokenizer.decode(list(s.tokens))) for s in sequences]
            rewards += group
            if max(group) > min(group):
                data += ex.group_data(prompt, sequences, group)
        t3 = time.perf_counter()
        if data:
            training.forward_backward(data, "stable_reinforce").result()
        t4 = time.perf_counter()
        if data:
            training.optim_step(adam).result()
        t5 = time.perf_counter()
        rows.append({"step": t5 - t0, "forward_backward": t4 - t3, "optim_step": t5 - t4,
                     "publish+load": t1 - t0, "sample": t2 - t1,
                     "reward": sum(rewards) / len(rewards)})  # fmt: skip
    service.close("success").result()
    return rows


def loop(model: Path, steps: int) -> None:
    """The native loop and the SDK loop, one after the other on the same two replicas."""
    import contextlib

    from asyncgrpo.serve import launch_replicas
    from asyncgrpo.testing import tiny_serve_config

    out = Path(tempfile.mkdtemp())
    with start_blocking_portal() as portal, contextlib.ExitStack() as stack:
        serve = tiny_serve_config(
            model,
            replicas=2,
            max_staleness=4,
            runs=2,
            transports=(str(out),),
            log_dir=str(out / "replica-logs"),
            adapter_cache_dir=str(out / "replica-adapters"),
        )
        replicas = stack.enter_context(portal.wrap_async_context_manager(launch_replicas(serve)))
        urls = [r.url for r in replicas]
        native = _native(model, urls, out / "runs", steps)
        config = TinkerConfig(
            model=str(model),
            port=0,
            dtype="float32",
            lora_alpha=2.0,
            upstreams=tuple(urls),
            work_dir=str(out / "tinker"),
            max_lora_rank=8,
        )
        url = stack.enter_context(portal.wrap_async_context_manager(serve_tinker(config)))
        sdk = _sdk(url, model, steps)
    parts = ["step", "forward_backward", "optim_step", "publish+load", "sample"]
    print(f"\nRL step, demo recipe (32 samples), {steps} steps each, median s over steps 2-{steps}")
    print(f"{'loop':<8}" + "".join(f"{p:>17}" for p in parts) + f"{'final reward':>14}")
    for name, rows in (("native", native), ("sdk", sdk)):
        cells = "".join(f"{statistics.median(r[p] for r in rows[1:]):>17.3f}" for p in parts)
        print(f"{name:<8}{cells}{statistics.mean(r['reward'] for r in rows[-3:]):>14.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=SAMPLES)
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--sampling", action="store_true", help="also the sampling side (vLLM)")
    parser.add_argument("--loop", action="store_true", help="also the RL step, native vs SDK")
    parser.add_argument("--steps", type=int, default=20, help="RL steps of each --loop loop")
    args = parser.parse_args()
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    import tinker
    from tinker import TensorData, types

    model = make_tiny_model(Path(tempfile.mkdtemp()) / "model")
    samples = make_samples(args.samples, G, 300)
    trainer = Trainer(
        model,
        lora=LoraConfig(r=1),
        seed=0,
        trainer=TrainerConfig(learning_rate=LR, samples_per_step=args.samples, dtype="float32"),
    )
    engine = Engine(model, dtype="float32", lora_alpha=2.0)
    engine.create("bench", LoraSpec(rank=1, seed=0, train_mlp=True, train_attn=True))
    wire = [
        WireDatum(
            tokens=np.asarray(i),
            inputs={
                "target_tokens": np.asarray(t),
                "logprobs": np.asarray(q, np.float32),
                "advantages": np.asarray(a, np.float32),
            },
        )
        for i, t, q, a in map(arrays, samples)
    ]
    request = FwdBwdRequest(
        model_id="bench",
        seq_id=1,
        loss_fn="importance_sampling",
        loss_fn_config={},
        forward_only=False,
        data=wire,
    )
    singles = [dataclasses.replace(request, data=[d]) for d in wire]
    step = AdamStep(
        learning_rate=LR, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, grad_clip_norm=0.0
    )
    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints(i),
            loss_fn_inputs={
                "target_tokens": t,
                "logprobs": TensorData(data=q, dtype="float32"),
                "advantages": TensorData(data=a, dtype="float32"),
            },
        )
        for i, t, q, a in map(arrays, samples)
    ]
    adam = types.AdamParams(learning_rate=LR, eps=1e-8)
    config = TinkerConfig(model=str(model), port=0, dtype="float32", lora_alpha=2.0)
    with (
        start_blocking_portal() as portal,
        portal.wrap_async_context_manager(serve_tinker(config)) as url,
    ):
        service = tinker.ServiceClient(base_url=url, api_key="tml-bench")
        client = service.create_lora_training_client(base_model=str(model), rank=1, seed=0).result()
        variants = {
            "native": lambda: trainer.step(samples),
            "engine": lambda: (engine.forward_backward(request), engine.optim_step("bench", step)),
            "per-datum": lambda: (
                [engine.forward_backward(r) for r in singles],
                engine.optim_step("bench", step),
            ),
            "sdk": lambda: (
                client.forward_backward(data, "importance_sampling").result(),
                client.optim_step(adam).result(),
            ),
        }
        times: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(args.rounds + 1):  # the first round warms up
            for name, run in variants.items():
                t0 = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - t0)
        service.close("success").result()
    tokens = sum(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    print(f"\n{args.samples} samples, {tokens} tokens per step, {args.rounds} rounds")
    print(f"{'variant':<10} {'median s/step':>14} {'min s/step':>11}")
    for name, ts in times.items():
        print(f"{name:<10} {statistics.median(ts[1:]):>14.3f} {min(ts[1:]):>11.3f}")
    if args.sampling:
        sampling(model, args.rounds)
    if args.loop:
        loop(model, args.steps)


if __name__ == "__main__":
    main()
