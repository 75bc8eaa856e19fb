"""The served-policy audit's cost beside a step's, and the logprob gaps its tolerance sits between.

(1) Cost: the demo recipe (``examples/tiny_cpu.yaml``: the tiny CPU model, 32 samples of up to
    32 completion tokens per step) on the trainer alone, no vLLM. Per round: one
    ``Trainer.step`` over a step's samples, then one audit as the run does it after a sync
    (``ServedPolicyAudit.after_sync``: ``trainer.audit.samples`` samples, the saved version's
    weights copied in, one forward, the current ones copied back). Samples are the model's own
    completions (sampled with ``generate``), their behaviour logprobs the trainer's at the saved
    version, so every audit passes. Median (and min) over the rounds after a warm-up round.
(2) Gaps, per policy token over the same completions: |bfloat16 - float32| (the trainer in
    bfloat16 against itself in float32, same adapter: one side's rounding; a bfloat16 vLLM
    against a bfloat16 trainer sits up to about twice that), and |v(N) - v(N-1)| in float32 (a
    replica serving the previous version under the new name: what the audit must catch), for
    versions one ``weight_sync_steps`` apart. Max, p99 and mean.

Run: ``python bench/audit.py [--rounds 10] [--samples 8] [--models tiny,25m]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import torch
import yaml

from asyncgrpo.config.training import TrainingConfig
from asyncgrpo.run.audit import ServedPolicyAudit
from asyncgrpo.sample import Sample
from asyncgrpo.testing.tiny import make_tiny_model
from asyncgrpo.trainer.loop import Trainer

RECIPE = Path(__file__).resolve().parents[1] / "examples" / "tiny_cpu.yaml"
MODELS: dict[str, dict[str, int]] = {
    "tiny": {},
    "25m": {"hidden_size": 512, "num_layers": 8, "num_heads": 8, "intermediate_size": 1408},
}


def recipe(model: Path, *overrides: str) -> TrainingConfig:
    data = yaml.safe_load(RECIPE.read_text())
    data["model"] = str(model)
    return TrainingConfig.from_dict(data, list(overrides))


def completions(trainer: Trainer, cfg: TrainingConfig, n: int, seed: int) -> list[Sample]:
    """``n`` completions the policy samples itself (groups of G per prompt, as a step's)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(cfg.model)
    g, length = cfg.generation.num_generations, cfg.generation.max_completion_length
    prompts = [tok.encode(p) for p in cfg.dataset.prompts]
    torch.manual_seed(seed)
    out: list[Sample] = []
    trainer.model.eval()
    with torch.no_grad():
        for k in range(0, n, g):
            prompt = prompts[(k // g) % len(prompts)]
            ids = trainer.model.generate(
                input_ids=torch.tensor([prompt]),
                do_sample=True,
                max_new_tokens=length,
                num_return_sequences=min(g, n - k),
                pad_token_id=tok.pad_token_id,
                top_k=0,
            )
            for j, row in enumerate(ids[:, len(prompt) :].tolist()):
                c = row if tok.pad_token_id not in row else row[: row.index(tok.pad_token_id)]
                c = c or row[:1]
                out.append(
                    Sample(
                        prompt_ids=prompt,
                        completion_ids=c,
                        logprobs=[0.0] * len(c),
                        reward=float(j % 2),
                        advantage=(j % 2) - 0.5,
                        version=0,
                        group_id=str(k // g),
                    )
                )
    trainer.model.train()
    return out


def served(trainer: Trainer, samples: list[Sample], version: int, replica: str) -> list[Sample]:
    lps = trainer.logprobs(samples)
    return [
        dataclasses.replace(s, logprobs=lp, version=version, replica=replica)
        for s, lp in zip(samples, lps, strict=True)
    ]


def cost(model: Path, rounds: int, k: int, work: Path) -> dict[str, Any]:
    """Median/min ms of a step and of an audit of ``k`` samples, the demo recipe."""
    cfg = recipe(model, f"trainer.audit.samples={k}")
    trainer = Trainer.from_config(cfg, device="cpu")
    step_samples = completions(trainer, cfg, cfg.trainer.samples_per_step, seed=0)
    dirs: dict[int, Path] = {}
    steps, audits = [], []
    for r in range(rounds + 1):
        dirs[r] = trainer.save_adapter(work / f"v{r}", version=r)
        batch = served(trainer, step_samples, r, f"http://replica-{r % 2}")
        audit = ServedPolicyAudit(cfg.trainer.audit, trainer, dirs.get)
        t0 = time.perf_counter()
        trainer.step(batch)
        t1 = time.perf_counter()
        audit.observe(batch)
        metrics = anyio.run(audit.after_sync)
        t2 = time.perf_counter()
        assert metrics["audit/max_abs_logprob_diff"] < 1e-4, metrics
        if r:  # round 0 warms up
            steps.append(1e3 * (t1 - t0))
            audits.append(1e3 * (t2 - t1))
    tokens = int(metrics["audit/tokens"])
    return {"step": steps, "audit": audits, "tokens": tokens}


def _gaps(a: list[list[float]], b: list[list[float]]) -> tuple[float, float, float]:
    d = sorted(abs(x - y) for p, q in zip(a, b, strict=True) for x, y in zip(p, q, strict=True))
    return d[-1], d[int(0.99 * (len(d) - 1))], sum(d) / len(d)


def gaps(model: Path, work: Path, syncs: int) -> dict[str, tuple[float, float, float]]:
    """|bf16 - fp32| at the trained version, and |v(N) - v(N-1)| in fp32 (max, p99, mean)."""
    cfg = recipe(model)
    trainer = Trainer.from_config(cfg, device="cpu")
    samples = completions(trainer, cfg, cfg.trainer.samples_per_step, seed=1)
    for _ in range(syncs):  # move the adapter away from its no-op start
        trainer.step(served(trainer, samples, 0, "r"))
    before = trainer.logprobs(samples)
    trainer.step(served(trainer, samples, 0, "r"))  # one sync apart (weight_sync_steps=1)
    after = trainer.logprobs(samples)
    saved = trainer.save_adapter(work / "gap", version=1)
    half = Trainer.from_config(recipe(model, "trainer.dtype=bfloat16"), device="cpu")
    bf16 = half.logprobs_at(samples, saved)
    return {"bf16 vs fp32": _gaps(bf16, after), "v(N) vs v(N-1), fp32": _gaps(before, after)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--samples", type=int, default=8, help="trainer.audit.samples")
    p.add_argument("--models", default="tiny", help="tiny, 25m, or both (comma-separated)")
    p.add_argument("--syncs", type=int, default=5, help="steps before the gaps are measured")
    args = p.parse_args()
    for name in args.models.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            model = make_tiny_model(Path(tmp) / "model", **MODELS[name])
            c = cost(model, args.rounds, args.samples, Path(tmp))
            med_s, med_a = statistics.median(c["step"]), statistics.median(c["audit"])
            print(
                f"\n{name}: ms per step vs per audit ({args.samples} samples, {c['tokens']} "
                f"tokens), median (min) of {args.rounds} rounds"
            )
            print(f"  step  {med_s:8.1f} ({min(c['step']):.1f})")
            print(
                f"  audit {med_a:8.1f} ({min(c['audit']):.1f})   {100 * med_a / med_s:.1f} % of a step"
            )
            print(f"{name}: |logprob gap| per policy token        max      p99     mean")
            for label, (mx, p99, mean) in gaps(model, Path(tmp), args.syncs).items():
                print(f"  {label:34s} {mx:8.2g} {p99:8.2g} {mean:8.2g}")


if __name__ == "__main__":
    main()
