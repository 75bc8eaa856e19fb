"""Trainer throughput side by side, two tables.

(1) packed rows vs one sequence per micro-batch, gradient checkpointing off vs on: builds a
    random Qwen2 (no download), makes GRPO-shaped synthetic samples (groups of G sharing a
    prompt), and times ``Trainer.step`` for each variant after a warm-up step.
(2) ``--vs-trl``: trainer only, identical samples: asyncgrpo's ``Trainer.step`` (varlen attention,
    and the dense-mask sdpa it replaced) vs TRL's ``GRPOTrainer`` doing its own loss
    (``compute_loss``: padded batch, fused LM head, ``dapo`` token-level loss), backward, gradient
    clipping and AdamW step on the same samples, padded as TRL pads them (prompts left, completions
    right). The two models of ``bench/train.py`` (tiny, ~22M). Variants are interleaved, one step
    each per round, so machine noise hits all of them alike; median (and min) of the rounds after
    a warm-up round.

Run: ``python bench/trainer.py [--samples 64] [--steps 3] [--hidden 256] [--layers 4]
[--vocab 4096] [--budget 4096] [--device cpu]`` or ``python bench/trainer.py --vs-trl
[--models tiny,25m] [--steps 5] [--samples 32]``.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from asyncgrpo.config.trainer import LoraConfig, TrainerConfig
from asyncgrpo.sample import Sample
from asyncgrpo.trainer.loop import Trainer

# ---- defaults -------------------------------------------------------------------------------
SAMPLES, G, STEPS, HIDDEN, LAYERS, VOCAB, BUDGET = 64, 8, 3, 256, 4, 4096, 4096
PROMPT_TOKENS, COMPLETION_TOKENS = (48, 160), (16, 128)


def build_model(path: str, hidden: int, layers: int, vocab: int) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=1,
        intermediate_size=4 * hidden,
        vocab_size=vocab,
        max_position_embeddings=4096,
    )
    model = Qwen2ForCausalLM(config)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters", flush=True)
    model.save_pretrained(path)


def make_samples(
    n: int,
    g: int,
    vocab: int,
    seed: int = 0,
    *,
    prompt_tokens: tuple[int, int] = PROMPT_TOKENS,
    completion_tokens: tuple[int, int] = COMPLETION_TOKENS,
) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for k in range(0, n, g):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(*prompt_tokens))]
        for _ in range(min(g, n - k)):
            c = rng.randint(*completion_tokens)
            out.append(
                Sample(
                    prompt_ids=prompt,
                    completion_ids=[rng.randrange(vocab) for _ in range(c)],
                    logprobs=[-rng.uniform(5, 9) for _ in range(c)],
                    reward=rng.random(),
                    advantage=rng.uniform(-1, 1),
                    version=0,
                    group_id=f"g{k}",
                )
            )
    return out


def run_variant(model_dir: str, samples, args, *, packed: bool, gc: bool) -> dict[str, float]:
    cfg = TrainerConfig(
        learning_rate=1e-5,
        token_budget=args.budget if packed else None,
        gradient_accumulation_steps=1 if packed else len(samples),
        gradient_checkpointing=gc,
        dtype="auto",
    )
    trainer = Trainer(model_dir, lora=LoraConfig(r=1), trainer=cfg, device=args.device)
    trainer.step(samples)  # warm-up
    rows = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        m = trainer.step(samples)
        rows.append((time.perf_counter() - t0, m))
    step_s = statistics.median(s for s, _ in rows)
    fwd_bwd = statistics.median(m["perf/fwd_bwd_s"] for _, m in rows)
    tokens = rows[0][1]["batch/tokens"]
    return {
        "micro": rows[0][1]["batch/microbatches_per_step"],
        "step_s": step_s,
        "fwd_bwd_s": fwd_bwd,
        "tok_s": tokens / step_s,
        "tokens": tokens,
    }


# ---- (2) asyncgrpo vs TRL, trainer only -----------------------------------------------------
VS_TRL_SAMPLES, VS_TRL_STEPS, VS_TRL_BUDGET, VS_TRL_LR = 32, 5, 4096, 3e-2
SDPA_BUDGET = 1024  # the dense-mask path's fastest budget on CPU (a row costs its length squared)
VS_TRL_PROMPT_TOKENS = (14, 24)  # the tiny chat template's prompts are about this long


class AsyncgrpoVariant:
    """``Trainer.step`` on the samples; the parts come from its own metrics."""

    def __init__(self, model_dir: str, samples: list[Sample], *, attn: str | None, budget: int):
        cfg = TrainerConfig(
            learning_rate=VS_TRL_LR,
            token_budget=budget,
            dtype="float32",
            attn_implementation=attn,
            max_grad_norm=1.0,
        )
        self.samples = samples
        self.trainer = Trainer(
            model_dir, lora=LoraConfig(r=1, alpha=2.0), trainer=cfg, device="cpu"
        )
        self.tokens = sum(s.num_tokens for s in samples)

    def step(self) -> dict[str, float]:
        t0 = time.perf_counter()
        m = self.trainer.step(self.samples)
        total = time.perf_counter() - t0
        return {
            "step": total,
            "fwd": m["perf/fwd_s"],
            "bwd": m["perf/fwd_bwd_s"] - m["perf/fwd_s"],
            "rest": total - m["perf/fwd_bwd_s"],
            "rows": m["batch/microbatches_per_step"],
        }


class TrlVariant:
    """TRL's GRPOTrainer: its ``compute_loss`` on a batch padded as TRL pads, backward, clip, AdamW.

    ``old_per_token_logps`` carries the samples' behaviour logprobs, so TRL's clipped ratio is
    the same quantity asyncgrpo's loss uses.
    """

    def __init__(self, model_dir: str, samples: list[Sample], tmp: str):
        from datasets import Dataset
        from peft import LoraConfig as PeftLoraConfig
        from transformers.utils import logging as hf_logging
        from trl import GRPOConfig, GRPOTrainer

        hf_logging.set_verbosity_error()
        args = GRPOConfig(
            output_dir=str(Path(tmp) / "trl"),
            per_device_train_batch_size=len(samples),
            num_generations=8,
            max_completion_length=max(len(s.completion_ids) for s in samples),
            learning_rate=VS_TRL_LR,
            max_grad_norm=1.0,
            beta=0.0,
            loss_type="dapo",
            bf16=False,
            use_cpu=True,
            model_init_kwargs={"dtype": torch.float32},
            report_to="none",
            save_strategy="no",
            disable_tqdm=True,
        )
        self.trainer = GRPOTrainer(
            model=model_dir,
            reward_funcs=lambda completions, **kw: [0.0] * len(completions),
            args=args,
            train_dataset=Dataset.from_dict({"prompt": ["x"] * len(samples)}),
            peft_config=PeftLoraConfig(
                r=1, lora_alpha=2.0, target_modules="all-linear", task_type="CAUSAL_LM"
            ),
        )
        self.trainer.create_optimizer()
        self.trainer.current_gradient_accumulation_steps = 1
        self.model = self.trainer.model
        self.model.train()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.inputs = self.batch(samples, self.trainer.processing_class.pad_token_id or 0)
        self.tokens = int(self.inputs["prompt_ids"].numel() + self.inputs["completion_ids"].numel())

    @staticmethod
    def batch(samples: list[Sample], pad: int) -> dict[str, Any]:
        p_len = max(len(s.prompt_ids) for s in samples)
        c_len = max(len(s.completion_ids) for s in samples)
        b = len(samples)
        prompt_ids = torch.full((b, p_len), pad, dtype=torch.long)
        prompt_mask = torch.zeros(b, p_len, dtype=torch.long)
        completion_ids = torch.full((b, c_len), pad, dtype=torch.long)
        completion_mask = torch.zeros(b, c_len, dtype=torch.long)
        old = torch.zeros(b, c_len)
        for i, s in enumerate(samples):
            p, c = len(s.prompt_ids), len(s.completion_ids)
            prompt_ids[i, p_len - p :] = torch.tensor(s.prompt_ids)
            prompt_mask[i, p_len - p :] = 1
            completion_ids[i, :c] = torch.tensor(s.completion_ids)
            completion_mask[i, :c] = 1
            old[i, :c] = torch.tensor(s.logprobs)
        return {
            "prompt_ids": prompt_ids,
            "prompt_mask": prompt_mask,
            "completion_ids": completion_ids,
            "completion_mask": completion_mask,
            "advantages": torch.tensor([s.advantage for s in samples]),
            "old_per_token_logps": old,
            "num_items_in_batch": completion_mask.sum(),
        }

    def step(self) -> dict[str, float]:
        t0 = time.perf_counter()
        loss = self.trainer.compute_loss(self.model, self.inputs)
        t1 = time.perf_counter()
        self.trainer.accelerator.backward(loss)
        t2 = time.perf_counter()
        self.trainer.accelerator.clip_grad_norm_(self.params, self.trainer.args.max_grad_norm)
        self.trainer.optimizer.step()
        self.trainer.optimizer.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        return {"step": t3 - t0, "fwd": t1 - t0, "bwd": t2 - t1, "rest": t3 - t2, "rows": 1.0}


def bench_vs_trl(args: argparse.Namespace) -> None:
    """Table (2): trainer time per step on identical samples, asyncgrpo vs TRL."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from train import COMPLETION_TOKENS as B_COMPLETION_TOKENS  # bench/train.py's two models
    from train import MODEL_DIMS

    from asyncgrpo.testing import make_tiny_model
    from asyncgrpo.trainer.attention import VARLEN_SDPA

    for key in args.models.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = str(make_tiny_model(Path(tmp) / "model", **MODEL_DIMS[key]))
            c = B_COMPLETION_TOKENS[key]
            samples = make_samples(
                args.samples,
                args.g,
                380,
                prompt_tokens=VS_TRL_PROMPT_TOKENS,
                completion_tokens=(c // 2, c),
            )
            variants: dict[str, Any] = {
                f"asyncgrpo varlen, {args.budget} tok/row": AsyncgrpoVariant(
                    model_dir, samples, attn=VARLEN_SDPA, budget=args.budget
                ),
                f"asyncgrpo sdpa mask, {SDPA_BUDGET} tok/row": AsyncgrpoVariant(
                    model_dir, samples, attn="sdpa", budget=SDPA_BUDGET
                ),
                "TRL GRPOTrainer (padded)": TrlVariant(model_dir, samples, tmp),
            }
            times: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
            for r in range(args.steps + 1):  # round 0 is the warm-up
                for name, v in variants.items():
                    out = v.step()
                    if r:
                        times[name].append(out)
            real = sum(s.num_tokens for s in samples)
            dims = MODEL_DIMS[key]
            print(
                f"\n(2) {key}: Qwen2 hidden {dims['hidden_size']} x {dims['num_layers']} layers, "
                f"{len(samples)} samples ({real} tokens; {c // 2}-{c}-token completions), "
                f"LoRA r=1 all-linear, {torch.get_num_threads()} torch threads; median of "
                f"{args.steps} interleaved rounds after 1 warm-up"
            )
            header = (
                f"{'variant':<34}{'rows':>5}{'computed tok':>13}{'step [s]':>10}{'min [s]':>9}"
                f"{'fwd':>7}{'bwd':>7}{'opt+rest':>9}{'vs TRL':>8}"
            )
            print(header)
            print("-" * len(header))
            trl = statistics.median(t["step"] for t in times["TRL GRPOTrainer (padded)"])
            for name, v in variants.items():
                ts = times[name]

                def med(k: str, ts: list[dict[str, float]] = ts) -> float:
                    return statistics.median(t[k] for t in ts)

                print(
                    f"{name:<34}{med('rows'):>5.0f}{v.tokens:>13}{med('step'):>10.3f}"
                    f"{min(t['step'] for t in ts):>9.3f}{med('fwd'):>7.3f}{med('bwd'):>7.3f}"
                    f"{med('rest'):>9.3f}{trl / med('step'):>7.2f}x",
                    flush=True,
                )
            del variants
            if math.isnan(trl):
                raise SystemExit("no TRL timing")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=None)
    p.add_argument("--g", type=int, default=G)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--hidden", type=int, default=HIDDEN)
    p.add_argument("--layers", type=int, default=LAYERS)
    p.add_argument("--vocab", type=int, default=VOCAB)
    p.add_argument("--budget", type=int, default=None)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--vs-trl", action="store_true", help="table (2): asyncgrpo vs TRL, trainer only"
    )
    p.add_argument("--models", default="tiny,25m", help="(2): tiny, 25m, or both")
    args = p.parse_args()
    if args.vs_trl:
        args.samples = args.samples or VS_TRL_SAMPLES
        args.budget = args.budget or VS_TRL_BUDGET
        args.steps = args.steps or VS_TRL_STEPS
        bench_vs_trl(args)
        return
    args.samples = args.samples or SAMPLES
    args.budget = args.budget or BUDGET
    args.steps = args.steps or STEPS
    with tempfile.TemporaryDirectory() as tmp:
        build_model(tmp, args.hidden, args.layers, args.vocab)
        samples = make_samples(args.samples, args.g, args.vocab)
        print(
            f"{len(samples)} samples, {sum(s.num_tokens for s in samples)} tokens, "
            f"device {args.device}, torch threads {torch.get_num_threads()}, "
            f"median of {args.steps} steps after 1 warm-up"
        )
        header = (
            f"{'variant':<28}{'micro-batches':>14}{'step [s]':>11}{'fwd+bwd [s]':>13}"
            f"{'tokens/s':>11}"
        )
        print(header)
        print("-" * len(header))
        for packed in (True, False):
            for gc in (False, True):
                r = run_variant(tmp, samples, args, packed=packed, gc=gc)
                name = ("packed " + str(args.budget) if packed else "one sequence/row") + (
                    ", ckpt on" if gc else ", ckpt off"
                )
                print(
                    f"{name:<28}{r['micro']:>14.0f}{r['step_s']:>11.2f}{r['fwd_bwd_s']:>13.2f}"
                    f"{r['tok_s']:>11.0f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
