"""Training bench, side by side in one run.

(a) Trainer throughput on synthetic GRPO samples, same model for every variant: packed rows
    (``token_budget``) vs one sequence per micro-batch, gradient checkpointing off vs on. The
    measuring code is ``bench/trainer.py`` (imported, not duplicated).
(b) Seconds per optimizer step and to a reward threshold: asyncgrpo (``run_training``: two local
    float32 vLLM replicas behind the proxy, async, adapter sync every ``weight_sync_steps``) vs
    TRL's ``GRPOTrainer`` (synchronous, transformers ``generate``), with the same recipe: model,
    LoRA config and starting LoRA weights, prompts in the same order, reward (``digit_fraction``),
    G, sampling parameters, completion length, loss, learning rate and schedule, clip range and
    samples per step (``tests/trainer/test_trl_parity.py`` shows the two compute the same
    advantages, loss, gradients and updates). What differs is the generation engine and its
    random draws, and on this task those decide when the reward takes off (the curve is steep:
    two runs of one trainer that differ only in their seed can end at 0.06 and at 0.98), so
    compare learning speed over several ``--seeds``. Two models, both built locally: the tiny CPU
    test model and a ~22M-parameter one (hidden 512, 8 layers) generating up to 128 tokens
    (generation-bound).
(c) Trainer only, identical samples: asyncgrpo's ``Trainer.step`` vs TRL's ``GRPOTrainer`` loss,
    backward and AdamW step on the same batch, for the two models of (b) (``bench/trainer.py
    --vs-trl``, imported).

Columns: ``setup`` is the wall time outside optimizer steps (model load, replica start-up, the
first adapter load, shutdown); ``s/step p50`` the median optimizer step, wait for rollouts
included; ``train`` their sum; ``wall`` everything. The reward threshold is on the 3-step moving
mean of the step reward (both trainers log the mean reward of the completions each step trained
on). Both variants start from the same policy (LoRA B = 0), so by default the threshold is
``--threshold-x`` (2) times the starting policy's reward, read from the first variant's first 3
steps: a random tiny model earns ~0.02 digit share, and doubling it is well above the step-to-step
noise (~0.005) yet within reach of 20 steps when learning works. ``thr [s]`` counts training time
up to that step (setup excluded). ``--threshold`` sets an absolute value instead.

Run: ``python bench/train.py`` (everything, about 20 min on 2 quiet cores), or e.g.
``python bench/train.py --parts b --models tiny --steps 2`` (a smoke run), or
``python bench/train.py --parts b --models tiny --seeds 0,1,2`` (three seeds per variant).
"""

from __future__ import annotations

import argparse
import gc
import logging
import math
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

# ---- defaults -------------------------------------------------------------------------------
STEPS = 20  # optimizer steps per (b) variant
THRESHOLD_X = 2.0  # default threshold: this many times the starting policy's reward
WINDOW = 3  # steps in that moving mean
PARTS = "a,c,b"
MODELS = "tiny,25m"
VARIANTS = "asyncgrpo,trl"
SEEDS = [0]  # (b) training seeds; each runs every variant
# (a): synthetic samples through asyncgrpo's Trainer (bench/trainer.py's model and samples)
A_SAMPLES, A_STEPS, A_HIDDEN, A_LAYERS, A_VOCAB, A_BUDGET = 24, 1, 256, 4, 4096, 4096
# (b): the two models; dims for asyncgrpo.testing.make_tiny_model (head_dim must be 64)
MODEL_DIMS: dict[str, dict[str, int]] = {
    "tiny": {"hidden_size": 128, "num_layers": 2, "num_heads": 2, "intermediate_size": 256},
    "25m": {"hidden_size": 512, "num_layers": 8, "num_heads": 8, "intermediate_size": 1408},
}
COMPLETION_TOKENS = {"tiny": 32, "25m": 128}
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tiny_cpu.yaml"


# ---- (a) trainer throughput --------------------------------------------------------------------
def bench_trainer(args: argparse.Namespace, tmp: Path) -> None:
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import trainer as trainer_bench  # bench/trainer.py

    ns = argparse.Namespace(budget=A_BUDGET, steps=args.a_steps, device="cpu")
    model_dir = tmp / "a-model"
    trainer_bench.build_model(str(model_dir), A_HIDDEN, A_LAYERS, A_VOCAB)
    samples = trainer_bench.make_samples(args.a_samples, 8, A_VOCAB)
    tokens = sum(s.num_tokens for s in samples)
    print(
        f"\n(a) trainer throughput: {len(samples)} samples ({tokens} tokens), random Qwen2 "
        f"hidden {A_HIDDEN} x {A_LAYERS} layers, vocab {A_VOCAB}, LoRA r=1 all-linear, "
        f"{torch.get_num_threads()} torch threads; median of {args.a_steps} steps after 1 warm-up"
    )
    header = (
        f"{'variant':<30}{'micro-batches':>14}{'step [s]':>10}{'fwd+bwd [s]':>13}"
        f"{'tokens/s':>10}{'vs packed':>11}"
    )
    print(header)
    print("-" * len(header))
    base = None
    for packed in (True, False):
        for ckpt in (False, True):
            r = trainer_bench.run_variant(str(model_dir), samples, ns, packed=packed, gc=ckpt)
            base = base or r["tok_s"]
            name = (f"packed ({A_BUDGET} tok/row)" if packed else "one sequence/micro-batch") + (
                ", ckpt on" if ckpt else ", ckpt off"
            )
            print(
                f"{name:<30}{r['micro']:>14.0f}{r['step_s']:>10.2f}{r['fwd_bwd_s']:>13.2f}"
                f"{r['tok_s']:>10.0f}{r['tok_s'] / base:>10.2f}x"
            )
            gc.collect()


# ---- (c) trainer only vs TRL ---------------------------------------------------------------------
def bench_trainer_vs_trl(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import trainer as trainer_bench  # bench/trainer.py

    print("\n(c) trainer only, identical samples: asyncgrpo vs TRL GRPOTrainer")
    ns = argparse.Namespace(
        models=args.models,
        samples=trainer_bench.VS_TRL_SAMPLES,
        g=8,
        steps=trainer_bench.VS_TRL_STEPS,
        budget=trainer_bench.VS_TRL_BUDGET,
    )
    trainer_bench.bench_vs_trl(ns)


# ---- (b) asyncgrpo vs TRL ----------------------------------------------------------------------
def reached(rewards: list[float], threshold: float) -> int | None:
    """1-based step at which the WINDOW-step moving mean of the reward first reaches threshold."""
    for k in range(WINDOW, len(rewards) + 1):
        window = [r for r in rewards[k - WINDOW : k] if not math.isnan(r)]
        if window and statistics.fmean(window) >= threshold:
            return k
    return None


def summarize_run(
    name: str, step_s: list[float], rewards: list[float], startup_s: float, wall_s: float
) -> dict[str, Any]:
    n = min(WINDOW, len(rewards))
    return {
        "variant": name,
        "step_s": step_s,
        "rewards": rewards,
        "startup_s": startup_s,
        "step_p50": statistics.median(step_s) if step_s else math.nan,
        "train_s": sum(step_s),
        "wall_s": wall_s,
        "reward_first": statistics.fmean(rewards[:n]) if rewards else math.nan,
        "reward_last": statistics.fmean(rewards[-n:]) if rewards else math.nan,
    }


def run_asyncgrpo(
    model: str, key: str, seed: int, args: argparse.Namespace, out: Path
) -> dict[str, Any]:
    import anyio

    from asyncgrpo.config.training import TrainingConfig
    from asyncgrpo.run.metrics import read_metrics
    from asyncgrpo.run.training import run_training

    steps = args.steps
    cfg = TrainingConfig.from_yaml(
        EXAMPLE,
        overrides=[
            f"model={model}",
            f"output_dir={out}",
            f"run_name=asyncgrpo-{key}-s{seed}",
            f"seed={seed}",
            f"trainer.max_steps={steps}",
            f"trainer.save_steps={steps}",  # one checkpoint, at the end (0 is not accepted here)
            f"generation.max_completion_length={COMPLETION_TOKENS[key]}",
            f"serve.replicas={args.replicas}",
        ],
    )
    t0 = time.perf_counter()
    result = anyio.run(run_training, cfg)
    wall = time.perf_counter() - t0
    records = read_metrics(result.run_dir)
    step_s = [r["perf/step_s"] for r in records]
    row = summarize_run(
        f"asyncgrpo ({cfg.serve.replicas} vLLM replicas) s{seed}",
        step_s,
        [r.get("reward", math.nan) for r in records],
        wall - sum(step_s),
        wall,
    )

    def mean(key: str) -> float:  # per step; a step without the key (no sync) counts as 0
        return sum(r.get(key) or 0.0 for r in records) / len(records)

    row["parts"] = {
        "rollout wait": mean("perf/rollout_wait_s"),
        "fwd+bwd": mean("perf/fwd_bwd_s"),
        "optimizer+pack": mean("perf/train_step_s") - mean("perf/fwd_bwd_s"),
        "weight sync": mean("perf/weight_sync_s"),
        "checkpoint": mean("perf/checkpoint_s"),
    }
    row["parts"]["other"] = statistics.fmean(step_s) - sum(row["parts"].values())
    row["gen_tok_s"] = (
        statistics.fmean(
            r["rollout/generated_tok_s"] for r in records if r.get("rollout/generated_tok_s")
        )
        if any(r.get("rollout/generated_tok_s") for r in records)
        else math.nan
    )
    row["config"] = cfg
    return row


def trl_prompts(model: str, cfg: Any, steps: int) -> list[Any]:
    """The prompts asyncgrpo's rollout client reads, in its order, for ``steps`` steps.

    TRL then reads them unshuffled (``shuffle_dataset=False``), so both trainers see the same
    prompt in the same step instead of two different permutations.
    """
    from asyncgrpo.rollout.dataset import PromptDataset, load_tokenizer

    dataset = PromptDataset.from_config(cfg.dataset, tokenizer=load_tokenizer(model))
    per_step = cfg.trainer.samples_per_step // cfg.generation.num_generations
    return [dataset.at(p).prompt for p in range(steps * per_step)]


def initial_adapter(model: str, cfg: Any) -> dict[str, Any]:
    """asyncgrpo's starting LoRA for ``cfg.seed`` (``Trainer`` seeds torch, then builds it)."""
    import torch

    from asyncgrpo.trainer.model import load_policy

    torch.manual_seed(cfg.seed)
    policy = load_policy(model, cfg.lora, dtype="float32", device="cpu")
    return {n: p.detach().clone() for n, p in policy.named_parameters() if p.requires_grad}


def run_trl(model: str, key: str, cfg: Any, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """TRL GRPOTrainer with asyncgrpo's recipe ``cfg`` (the run just measured).

    Same model, LoRA config *and* starting LoRA weights, prompts in the same order, sampling
    parameters, loss (``dapo``, ``beta=0``, clip range, ``delta`` = ``importance_cap`` of
    ``off_policy=none``), advantages
    (``scale_rewards="group"``), optimizer, schedule and samples per step. What stays different
    is the generation engine (transformers ``generate``, synchronous) and its random draws.
    """
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    from asyncgrpo.testing.rewards import digit_fraction

    t0 = time.perf_counter()
    tc, gen = cfg.trainer, cfg.generation
    if tc.max_staleness != 0 or tc.weight_sync_steps != 1:
        print(
            f"  note: trainer.max_staleness={tc.max_staleness}, weight_sync_steps="
            f"{tc.weight_sync_steps}: asyncgrpo trains off-policy, TRL's GRPOTrainer on-policy"
        )
    grpo = GRPOConfig(
        output_dir=str(out / f"trl-{key}"),
        max_steps=args.steps,
        per_device_train_batch_size=tc.samples_per_step,  # one step = samples_per_step samples
        gradient_accumulation_steps=1,
        num_generations=gen.num_generations,
        max_completion_length=gen.max_completion_length,
        temperature=gen.temperature,
        top_p=gen.top_p,
        top_k=max(gen.top_k, 0),  # off: -1 for vLLM, 0 for transformers
        min_p=gen.min_p or None,
        repetition_penalty=gen.repetition_penalty,
        learning_rate=tc.learning_rate,
        lr_scheduler_type=tc.lr_schedule,
        warmup_steps=tc.warmup_steps,
        weight_decay=tc.weight_decay,
        max_grad_norm=tc.max_grad_norm,
        epsilon=tc.epsilon,
        epsilon_high=tc.clip_high,
        # the same ratio cap (tests/trainer/test_trl_parity.py); TRL has no other correction
        delta=tc.importance_cap if tc.off_policy == "none" else None,
        beta=0.0,  # no KL term, like asyncgrpo
        num_iterations=1,
        loss_type="dapo",  # token-level mean over the step, like asyncgrpo
        scale_rewards="group",  # (r - mean) / std within the group, like asyncgrpo
        shuffle_dataset=False,  # the rows are already in asyncgrpo's order
        seed=cfg.seed,
        data_seed=cfg.seed,
        bf16=False,
        gradient_checkpointing=tc.gradient_checkpointing,
        use_cpu=True,
        model_init_kwargs={"dtype": torch.float32},
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    peft_config = LoraConfig(
        r=cfg.lora.r,
        lora_alpha=cfg.lora.alpha,
        target_modules=cfg.lora.target_modules,
        lora_dropout=cfg.lora.dropout,
        task_type="CAUSAL_LM",
    )
    dataset = Dataset.from_dict({"prompt": trl_prompts(model, cfg, args.steps)})
    marks: list[float] = []
    rewards: list[float] = []
    gen_s: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *a: Any, **kw: Any) -> None:
            marks.append(time.perf_counter())

        def on_step_end(self, *a: Any, **kw: Any) -> None:
            marks.append(time.perf_counter())

        def on_log(self, *a: Any, logs: dict[str, float] | None = None, **kw: Any) -> None:
            if logs and "reward" in logs:
                rewards.append(float(logs["reward"]))

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=digit_fraction,
        args=grpo,
        train_dataset=dataset,
        peft_config=peft_config,
        callbacks=[Clock()],
    )
    # Start from asyncgrpo's LoRA weights (B = 0 either way; A is drawn from torch's RNG, and
    # the two trainers consume it differently before the draw).
    start = initial_adapter(model, cfg)
    params = dict(trainer.model.named_parameters())
    with torch.no_grad():
        for name, value in start.items():
            params[name].copy_(value)
    generate = trainer._generate_and_score_completions

    def timed_generate(*a: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        try:
            return generate(*a, **kw)
        finally:
            gen_s.append(time.perf_counter() - t)

    trainer._generate_and_score_completions = timed_generate
    trainer.remove_callback(PrinterCallback)  # it prints every log dict
    trainer.train()
    wall = time.perf_counter() - t0
    step_s = [marks[i + 1] - marks[i] for i in range(0, len(marks) - 1, 2)]
    row = summarize_run(
        f"TRL GRPOTrainer (sync) s{cfg.seed}", step_s, rewards, wall - sum(step_s), wall
    )
    g = statistics.fmean(gen_s) if gen_s else math.nan
    row["parts"] = {"generate+score": g, "fwd+bwd+optimizer": statistics.fmean(step_s) - g}
    del trainer
    gc.collect()
    return row


def print_b(key: str, rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    dims = MODEL_DIMS[key]
    # Every run starts from the same policy (LoRA B = 0), so the runs' opening reward is the
    # starting policy's; the default threshold is a multiple of it.
    start = statistics.fmean(r["reward_first"] for r in rows)
    thr = args.threshold if args.threshold is not None else args.threshold_x * start
    how = "given" if args.threshold is not None else f"{args.threshold_x:g} x start {start:.3f}"
    for r in rows:
        k = reached(r["rewards"], thr)
        r["thr_step"], r["thr_s"] = k, (sum(r["step_s"][:k]) if k else None)
    print(
        f"\n(b) {key}: Qwen2 hidden {dims['hidden_size']} x {dims['num_layers']} layers, "
        f"{rows[0].get('params_m', math.nan):.1f} M parameters, {COMPLETION_TOKENS[key]}-token "
        f"completions, {args.steps} steps; threshold: {WINDOW}-step mean reward >= "
        f"{thr:.3f} ({how})"
    )
    header = (
        f"{'variant':<32}{'setup [s]':>10}{'s/step p50':>11}{'train [s]':>10}{'wall [s]':>9}"
        f"{'reward first3':>14}{'last3':>7}{'thr step':>9}{'thr [s]':>8}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        thr_step = str(r["thr_step"]) if r["thr_step"] else "-"
        thr_s = f"{r['thr_s']:.0f}" if r["thr_s"] is not None else "-"
        print(
            f"{r['variant']:<32}{r['startup_s']:>10.0f}{r['step_p50']:>11.2f}{r['train_s']:>10.0f}"
            f"{r['wall_s']:>9.0f}{r['reward_first']:>14.3f}{r['reward_last']:>7.3f}"
            f"{thr_step:>9}{thr_s:>8}"
        )
    for r in rows:
        curve = " ".join(f"{x:.2f}" for x in r["rewards"])
        print(f"  {r['variant']}: reward by step: {curve}")
    for r in rows:
        parts = ", ".join(f"{k} {v:.2f}" for k, v in r["parts"].items())
        extra = f"; vLLM {r['gen_tok_s']:.0f} tok/s" if "gen_tok_s" in r else ""
        print(f"  {r['variant']}: mean s/step = {parts}{extra}")
    kinds = sorted({r["kind"] for r in rows})
    if len(args.seeds) > 1:  # the reward curve is steep: one seed says little about speed
        for kind in kinds:
            mine = [r for r in rows if r["kind"] == kind]
            steps = sorted(r["thr_step"] or args.steps + 1 for r in mine)
            print(
                f"  {kind}: over {len(mine)} seeds, last3 reward median "
                f"{statistics.median(r['reward_last'] for r in mine):.3f} (min "
                f"{min(r['reward_last'] for r in mine):.3f}, max "
                f"{max(r['reward_last'] for r in mine):.3f}); thr step median "
                f"{statistics.median(steps):g} (- counts as {args.steps + 1})"
            )
    if len(rows) == 2:
        a, b = rows
        faster = a if a["step_p50"] < b["step_p50"] else b
        slower = b if faster is a else a
        print(
            f"  per step: {faster['variant']} wins, {slower['step_p50'] / faster['step_p50']:.2f}x"
        )
        if a["thr_s"] is not None or b["thr_s"] is not None:
            done = [r for r in rows if r["thr_s"] is not None]
            win = min(done, key=lambda r: r["thr_s"])
            print(f"  to threshold: {win['variant']} first ({win['thr_s']:.0f} s training)")
        else:
            print("  to threshold: neither reached it")


def bench_runs(args: argparse.Namespace, tmp: Path) -> None:
    from asyncgrpo.testing import make_tiny_model

    for key in args.models.split(","):
        model = make_tiny_model(tmp / f"model-{key}", seed=args.seed, **MODEL_DIMS[key])
        from safetensors import safe_open

        with safe_open(str(model / "model.safetensors"), "pt") as f:
            params = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
        rows: list[dict[str, Any]] = []
        variants = args.variants.split(",")
        for seed in args.seeds:
            cfg = None
            if "asyncgrpo" in variants:
                rows.append(run_asyncgrpo(str(model), key, seed, args, tmp))
                rows[-1]["kind"] = "asyncgrpo"
                cfg = rows[-1]["config"]
            if "trl" in variants:
                if cfg is None:
                    from asyncgrpo.config.training import TrainingConfig

                    cfg = TrainingConfig.from_yaml(
                        EXAMPLE,
                        overrides=[
                            f"model={model}",
                            f"seed={seed}",
                            f"generation.max_completion_length={COMPLETION_TOKENS[key]}",
                        ],
                    )
                rows.append(run_trl(str(model), key, cfg, args, tmp))
                rows[-1]["kind"] = "TRL"
        rows[0]["params_m"] = params / 1e6
        print_b(key, rows, args)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--parts",
        default=PARTS,
        help="a (trainer), c (trainer vs TRL), b (runs vs TRL), e.g. a,c,b",
    )
    p.add_argument("--models", default=MODELS, help="(b, c) models: tiny, 25m, or both")
    p.add_argument("--variants", default=VARIANTS, help="(b) asyncgrpo, trl, or both")
    p.add_argument("--steps", type=int, default=STEPS, help="(b) optimizer steps per variant")
    p.add_argument("--threshold", type=float, default=None, help="(b) absolute reward threshold")
    p.add_argument(
        "--threshold-x",
        type=float,
        default=THRESHOLD_X,
        help="(b) without --threshold: this many times the starting policy's reward",
    )
    p.add_argument("--replicas", type=int, default=2, help="(b) local vLLM replicas")
    p.add_argument("--seed", type=int, default=0, help="seed of the (b) models' weights")
    p.add_argument(
        "--seeds",
        type=lambda v: [int(x) for x in v.split(",")],
        default=SEEDS,
        help="(b) training seeds (LoRA init, prompt order, sampling), e.g. 0,1,2",
    )
    p.add_argument("--a-samples", type=int, default=A_SAMPLES, help="(a) samples per step")
    p.add_argument("--a-steps", type=int, default=A_STEPS, help="(a) timed steps per variant")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    warnings.filterwarnings("ignore")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    started = time.perf_counter()
    print(f"load average at start: {os.getloadavg()[0]:.1f} (1 min), {os.cpu_count()} cores")
    with tempfile.TemporaryDirectory(prefix="bench-train-") as tmp:
        if "a" in args.parts:
            bench_trainer(args, Path(tmp))
        if "c" in args.parts:
            bench_trainer_vs_trl(args)
        if "b" in args.parts:
            bench_runs(args, Path(tmp))
    print(
        f"\ntotal {time.perf_counter() - started:.0f} s; "
        f"load average at end: {os.getloadavg()[0]:.1f} (1 min)"
    )


if __name__ == "__main__":
    main()
