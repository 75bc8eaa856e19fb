"""The cost of the Tinker API on the training side, side by side in one run.

Three variants take one optimizer step over the same GRPO-shaped synthetic samples (groups
of G sharing a prompt) on the tiny model:

- ``native``: ``Trainer.step`` (packed rows, the GRPO loss), as ``asyncgrpo train`` runs it;
- ``engine``: the service's engine called directly (one forward per datum,
  ``importance_sampling``, then AdamW), no HTTP;
- ``sdk``: the same through the ``tinker`` SDK against the service on loopback
  (``forward_backward`` + ``optim_step``, protobuf bodies, futures polled).

``sdk`` minus ``engine`` is what the API costs; ``engine`` minus ``native`` what per-datum
forwards cost against packed rows. Variants are interleaved, one step each per round; the
median (and min) of the rounds after a warm-up round.

``--sampling`` adds the sampling side (two float32 vLLM replicas of the tiny model behind the
proxy, started here): requests/s of the same ``sample`` calls (one prompt, ``n`` samples each,
``--concurrency`` in flight) through the service and the SDK, and sent to the proxy directly as
vLLM completions, interleaved in rounds.

Run: ``python bench/tinker.py [--samples 32] [--rounds 5] [--sampling]``.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script, this file's directory comes first on sys.path and this file would shadow
# the tinker SDK it benchmarks (`import tinker`).
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)

import argparse
import os
import statistics
import tempfile
import time

import numpy as np
from anyio.from_thread import start_blocking_portal

from asyncgrpo.sample import Sample
from asyncgrpo.testing import make_tiny_model
from asyncgrpo.tinker import TinkerConfig, serve_tinker
from asyncgrpo.tinker.engine import AdamStep, Engine, LoraSpec
from asyncgrpo.tinker.wire import FwdBwdRequest, WireDatum
from asyncgrpo.trainer.config import LoraConfig, TrainerConfig
from asyncgrpo.trainer.loop import Trainer

# ---- defaults -------------------------------------------------------------------------------
SAMPLES, G, ROUNDS, PROMPT, COMPLETION, LR = 32, 8, 5, 24, 32, 1e-3


def make_samples(n: int, g: int, vocab: int) -> list[Sample]:
    rng = np.random.default_rng(0)
    out = []
    for k in range(0, n, g):
        prompt = rng.integers(0, vocab, PROMPT).tolist()
        for _ in range(g):
            out.append(Sample(prompt_ids=prompt, completion_ids=rng.integers(0, vocab, COMPLETION).tolist(),
                              logprobs=(-rng.uniform(4, 7, COMPLETION)).tolist(), reward=0.0,
                              advantage=float(rng.uniform(-1, 1)), version=0, group_id=f"g{k}"))  # fmt: skip
    return out


def arrays(s: Sample) -> tuple[list[int], list[int], list[float], list[float]]:
    """A sample as a Datum's input tokens, targets, sampler logprobs and advantages."""
    full = s.prompt_ids + s.completion_ids
    pad = [0.0] * (len(s.prompt_ids) - 1)
    adv = [s.advantage] * len(s.completion_ids)
    return full[:-1], full[1:], pad + list(s.logprobs), pad + adv


async def _proxy_rate(url: str, model: str, prompt: list[int], n: int, calls: int,
                      concurrency: int) -> float:  # fmt: skip
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
        replicas = stack.enter_context(portal.wrap_async_context_manager(
            launch_replicas(tiny_serve_config(model, replicas=2))))  # fmt: skip
        proxy = stack.enter_context(portal.wrap_async_context_manager(serve_proxy(
            ProxyConfig(upstreams=tuple(r.url for r in replicas), port=0))))  # fmt: skip
        config = TinkerConfig(model=str(model), port=0, dtype="float32", proxy_url=proxy,
                              work_dir=tempfile.mkdtemp())  # fmt: skip
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
            rates["proxy"].append(portal.call(_proxy_rate, proxy, str(model), prompt, n, calls,
                                              concurrency))  # fmt: skip
            rates["sdk"].append(sdk_rate())
        service.close("success").result()
    print(f"\nsample: {calls} calls of n={n}, {concurrency} in flight, 16 tokens, {rounds} rounds")
    print(f"{'path':<8} {'median req/s':>13} {'max req/s':>10}")
    for name, rs in rates.items():
        print(f"{name:<8} {statistics.median(rs[1:]):>13.1f} {max(rs[1:]):>10.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=SAMPLES)
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--sampling", action="store_true", help="also the sampling side (vLLM)")
    args = parser.parse_args()
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    import tinker
    from tinker import TensorData, types

    model = make_tiny_model(Path(tempfile.mkdtemp()) / "model")
    samples = make_samples(args.samples, G, 300)
    trainer = Trainer(model, lora=LoraConfig(r=1), seed=0,
                      trainer=TrainerConfig(learning_rate=LR, samples_per_step=args.samples,
                                            dtype="float32"))  # fmt: skip
    engine = Engine(model, dtype="float32", lora_alpha=2.0)
    engine.create("bench", LoraSpec(rank=1, seed=0, train_mlp=True, train_attn=True))
    wire = [WireDatum(tokens=np.asarray(i), inputs={"target_tokens": np.asarray(t),
                      "logprobs": np.asarray(q, np.float32), "advantages": np.asarray(a, np.float32)})
            for i, t, q, a in map(arrays, samples)]  # fmt: skip
    request = FwdBwdRequest(model_id="bench", seq_id=1, loss_fn="importance_sampling",
                            loss_fn_config={}, forward_only=False, data=wire)  # fmt: skip
    step = AdamStep(learning_rate=LR, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0,
                    grad_clip_norm=0.0)  # fmt: skip
    data = [types.Datum(model_input=types.ModelInput.from_ints(i),
                        loss_fn_inputs={"target_tokens": t, "logprobs": TensorData(data=q, dtype="float32"),
                                        "advantages": TensorData(data=a, dtype="float32")})
            for i, t, q, a in map(arrays, samples)]  # fmt: skip
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
            "sdk": lambda: (client.forward_backward(data, "importance_sampling").result(),
                            client.optim_step(adam).result()),
        }  # fmt: skip
        times: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(args.rounds + 1):  # the first round warms up
            for name, run in variants.items():
                t0 = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - t0)
        service.close("success").result()
    tokens = sum(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    print(f"\n{args.samples} samples, {tokens} tokens per step, {args.rounds} rounds")
    print(f"{'variant':<8} {'median s/step':>14} {'min s/step':>11}")
    for name, ts in times.items():
        print(f"{name:<8} {statistics.median(ts[1:]):>14.3f} {min(ts[1:]):>11.3f}")
    if args.sampling:
        sampling(model, args.rounds)


if __name__ == "__main__":
    main()
