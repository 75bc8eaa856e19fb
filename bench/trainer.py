"""Trainer throughput side by side: packed rows vs one sequence per micro-batch, gradient
checkpointing off vs on.

Builds a random Qwen2 (no download), makes GRPO-shaped synthetic samples (groups of G sharing
a prompt), and times ``Trainer.step`` for each variant after a warm-up step. Prints optimizer
step time, forward+backward time, micro-batches per step and trained tokens/s.

Run: ``python bench/trainer.py [--samples 64] [--steps 3] [--hidden 256] [--layers 4]
[--vocab 4096] [--budget 4096] [--device cpu]``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

import torch

from asyncgrpo.config import LoraConfig, TrainerConfig
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


def make_samples(n: int, g: int, vocab: int, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for k in range(0, n, g):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(*PROMPT_TOKENS))]
        for _ in range(min(g, n - k)):
            c = rng.randint(*COMPLETION_TOKENS)
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=SAMPLES)
    p.add_argument("--g", type=int, default=G)
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--hidden", type=int, default=HIDDEN)
    p.add_argument("--layers", type=int, default=LAYERS)
    p.add_argument("--vocab", type=int, default=VOCAB)
    p.add_argument("--budget", type=int, default=BUDGET)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
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
