"""The tiny CPU demos: async GRPO training end to end, and the served-logprob check.

Steps: build a tiny Qwen2 model and a LoRA adapter locally, start vLLM replicas, load the adapter
on every replica, generate, and compare each served token logprob with transformers + peft.
Equality (float32, ~1e-7) is what lets async GRPO trust the behaviour logprobs vLLM returns.
"""

from __future__ import annotations

import json
import math
import shutil
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING

import anyio

from asyncgrpo.errors import ConfigError
from asyncgrpo.evaluation.records import read_evals
from asyncgrpo.serve import launch_replicas
from asyncgrpo.testing import (
    make_lora_adapter,
    make_tiny_model,
    reference_logprobs,
    tiny_serve_config,
)
from asyncgrpo.testing.verify import served_logprob_errors
from asyncgrpo.vllm.client import VLLMClient

if TYPE_CHECKING:
    from asyncgrpo.config.training import TrainingConfig

TOLERANCE = 1e-4
#: In every directory a demo writes: the next demo may empty it (and nothing else).
MARKER = ".asyncgrpo-demo"


def prepare_output_dir(output_dir: Path, *, fresh: bool, dry_run: bool = False) -> Path:
    """``output_dir``, created, marked as a demo's, and emptied first when ``fresh``. A
    directory holding files no demo wrote is refused, not deleted: ``--output-dir ~`` must not
    cost the user their home directory. ``dry_run``: only checked (nothing made or emptied)."""
    from asyncgrpo.config.paths import check_writable

    output_dir = output_dir.resolve()
    try:
        if output_dir.exists() and (output_dir / MARKER).exists():
            if fresh and not dry_run:
                shutil.rmtree(output_dir)
        elif output_dir.exists() and any(output_dir.iterdir()):
            raise ConfigError(
                f"--output-dir {output_dir} holds files no demo wrote (or a demo's from before "
                "demos marked their directory): give a new or empty directory"
            )
        check_writable(output_dir, "--output-dir")
        if dry_run:
            return output_dir
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / MARKER).write_text("written by asyncgrpo's demos; the next one empties it\n")
    except OSError as exc:
        raise ConfigError(f"--output-dir {output_dir}: {exc.strerror or exc}") from None
    return output_dir


async def run_serving_check(output_dir: Path, replicas: int = 2) -> None:
    from transformers import AutoTokenizer

    started = time.monotonic()
    output_dir = await anyio.to_thread.run_sync(lambda: prepare_output_dir(output_dir, fresh=False))
    print(f"[1/4] building a tiny model and a LoRA adapter in {output_dir}")
    model = await anyio.to_thread.run_sync(make_tiny_model, output_dir / "model")
    adapter = await anyio.to_thread.run_sync(make_lora_adapter, model, output_dir / "adapter")
    tok = AutoTokenizer.from_pretrained(model)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "what is two plus three?"}], add_generation_prompt=True
    )
    prompt = list(prompt if isinstance(prompt, list) else prompt["input_ids"])

    print(f"[2/4] starting {replicas} vLLM replicas (about 30-120 s on 2 CPU cores)")
    config = tiny_serve_config(model, replicas=replicas, log_dir=str(output_dir / "logs"))
    rows = []
    async with launch_replicas(config) as running:
        for r in running:
            print(f"      replica {r.index}: {r.url} healthy after {r.started_s:.1f} s")
        print("[3/4] loading the adapter on every replica and generating")
        for r in running:
            async with VLLMClient(r.url) as client:
                await client.load_lora_adapter("demo-v1", str(adapter))
                body = await client.completions(
                    {
                        "model": "demo-v1",
                        "prompt": prompt,
                        "max_tokens": 32,
                        "temperature": 1.0,
                        "logprobs": 0,
                        "return_token_ids": True,
                    }
                )
            choice = body["choices"][0]
            rows.append((r.index, choice["token_ids"], choice["logprobs"]["token_logprobs"]))

    print("[4/4] recomputing the same tokens with transformers + peft (float32)")
    results = []
    for index, tokens, served in rows:
        ours = await anyio.to_thread.run_sync(
            lambda t=tokens: reference_logprobs(model, adapter, prompt, t)
        )
        diff = max(abs(a - b) for a, b in zip(ours, served, strict=True))
        results.append({"replica": index, "tokens": len(tokens), "max_abs_diff": diff})
    print(f"\n{'replica':>7} {'tokens':>6} {'max |logp_vllm - logp_trainer|':>32}")
    for row in results:
        print(f"{row['replica']:>7} {row['tokens']:>6} {row['max_abs_diff']:>32.2e}")
    ok = all(row["max_abs_diff"] < TOLERANCE for row in results)
    await anyio.Path(output_dir / "logprob_check.json").write_text(json.dumps(results, indent=2))
    print(
        f"\n{'OK' if ok else 'MISMATCH'}: served logprobs {'equal' if ok else 'differ from'} "
        f"the trainer's within {TOLERANCE:g} ({time.monotonic() - started:.0f} s)"
    )
    if not ok:
        raise SystemExit(1)


EXAMPLE_CONFIG = Path(__file__).resolve().parents[2] / "examples" / "tiny_cpu.yaml"


def demo_config(output_dir: Path, max_steps: int | None = None) -> TrainingConfig:
    """The demo's run: the example config, training the model built in ``output_dir/model``,
    with ``output_dir`` as its run directory."""
    from asyncgrpo.config.training import TrainingConfig

    if not EXAMPLE_CONFIG.exists():
        raise ConfigError(f"the demo config {EXAMPLE_CONFIG} is missing: run it from a checkout")
    output_dir = output_dir.resolve()
    overrides = [
        f"model={output_dir / 'model'}",
        f"output_dir={output_dir.parent}",
        f"run_name={output_dir.name}",
    ]
    if max_steps is not None:
        overrides.append(f"trainer.max_steps={max_steps}")
    return TrainingConfig.from_yaml(EXAMPLE_CONFIG, overrides=overrides)


async def run_demo(output_dir: Path, max_steps: int | None = None) -> None:
    """Train the tiny model with async GRPO on 2 CPU replicas; leave metrics and a plot.

    Asynchronous: the replicas generate up to ``trainer.max_staleness`` versions ahead of the
    trainer, and the loss corrects for it (``trainer.off_policy``).
    """
    from asyncgrpo.cli.plot import plot_run
    from asyncgrpo.run.metrics import METRICS_FILE, read_metrics, summarize
    from asyncgrpo.run.progress import ConsoleProgress
    from asyncgrpo.run.training import run_training

    started = time.monotonic()
    output_dir = await anyio.to_thread.run_sync(lambda: prepare_output_dir(output_dir, fresh=True))
    cfg = demo_config(output_dir, max_steps)  # a bad --max-steps fails before the model
    print(f"building a tiny Qwen2 model in {output_dir / 'model'}")
    model = await anyio.to_thread.run_sync(make_tiny_model, output_dir / "model")
    print("vLLM replicas and the proxy take about 1-2 min to start on 2 cores")

    recent: list = []  # the samples of the last few steps, for the exactness check

    def keep_recent(step: int, samples: list, version: int) -> None:
        recent.append(list(samples))
        del recent[:-4]

    with ConsoleProgress(cfg.trainer.max_steps) as progress:
        result = await run_training(cfg, progress=progress, on_step=keep_recent)
    samples = [s for batch in recent for s in batch]
    errors = await anyio.to_thread.run_sync(
        served_logprob_errors,
        model,
        result.transport_url,
        result.adapter_prefix,
        samples,
        output_dir / "verify-cache",
    )
    records = read_metrics(result.run_dir / METRICS_FILE)
    plot = await anyio.to_thread.run_sync(plot_run, result.run_dir)
    first, last = summarize(records, "reward")
    # the ratio exists on steps that trained on tokens of the trainer's current weights
    ratios = [r["ratio"] for r in records if not math.isnan(r.get("ratio", math.nan))]
    stale = statistics.fmean(r.get("sample/staleness_mean", 0.0) for r in records)
    print(
        f"\n{'steps':>5} {'versions':>8} {'reward first 5':>14} {'reward last 5':>13} "
        f"{'staleness':>9} {'ratio min':>9} {'ratio max':>9} {'wall s':>7}"
    )
    print(
        f"{result.steps:>5} {result.final_version + 1:>8} {first:>14.3f} {last:>13.3f} "
        f"{stale:>9.2f} {min(ratios, default=math.nan):>9.5f} "
        f"{max(ratios, default=math.nan):>9.5f} {time.monotonic() - started:>7.0f}"
    )
    print(
        f"(staleness: mean versions behind the trainer of the samples it trained on; ratio: "
        f"trainer over vLLM on tokens of its current weights, {len(ratios)} of "
        f"{len(records)} steps had some)"
    )
    print(
        f"\nserved vs trainer logprobs (last 4 steps, {len(samples)} samples, each at its "
        f"adapter version): max |diff| = {max(errors):.1e}"
    )
    _print_audit(records)
    evals = read_evals(result.run_dir)
    if len(evals) >= 2:
        base, final = evals[0], evals[-1]
        k = cfg.eval.num_generations if cfg.eval else 1
        print(
            f"held-out reward ({int(base['eval/prompts'])} prompts the trainer never saw, k={k}): "
            f"base {base['eval/reward']:.3f} -> final {final['eval/reward']:.3f} (pass@1 "
            f"{base.get('eval/pass@1', math.nan):.2f} -> {final.get('eval/pass@1', math.nan):.2f})"
        )
    print(f"metrics: {result.run_dir / METRICS_FILE}\nplot:    {plot}")
    if max(errors) > 1e-3:
        raise SystemExit("MISMATCH: a replica served something other than the trained policy")


def _print_audit(records: list[dict[str, float]]) -> None:
    """The served-policy audit's figure over the run (``trainer.audit``), when it ran."""
    audited = [r for r in records if "audit/tokens" in r]
    if audited:
        tokens = sum(int(r["audit/tokens"]) for r in audited)
        worst = max(r["audit/max_abs_logprob_diff"] for r in audited)
        print(
            f"served-policy audit (trainer.audit, after every sync): {len(audited)} audits, "
            f"{tokens} tokens, max |diff| = {worst:.1e}"
        )
