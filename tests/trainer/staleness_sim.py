"""Async GRPO without vLLM: rollouts drawn from the trainer's own policy, a fixed number of
versions behind it, deterministically.

Every step samples ``prompts x group`` completions from the adapter as it was ``staleness``
optimizer steps ago (the worst case of a run at ``max_staleness``: every sample as old as
allowed), with the exact behaviour logprobs of that policy, rewards them with the share of
"digit" tokens (ids below ``DIGITS``, as ``digit_fraction`` on the demo), and takes one
``Trainer.step``. No serving mismatch, no scheduling noise: only staleness differs between
runs, so it isolates what the off-policy correction is for.
"""

from __future__ import annotations

import tempfile
from collections import deque
from pathlib import Path
from typing import Any

import torch

from asyncgrpo.sample import Sample, group_advantages
from asyncgrpo.trainer.config import LoraConfig, TrainerConfig
from asyncgrpo.trainer.loop import Trainer

DIGITS = 12  # token ids 0..11 earn reward
DEMO = Path(__file__).resolve().parents[2] / "examples" / "tiny_cpu.yaml"
#: the optimisation settings of the demo recipe the simulation takes over (the rest is its own)
RECIPE_FIELDS = ("learning_rate", "scale_rewards", "loss_type", "beta", "adam_beta1", "adam_epsilon",
                 "adam_beta2", "max_grad_norm", "off_policy", "importance_cap",
                 "max_update_kl", "update_kl", "update_kl_history", "max_update_rms",
                 "spike_clip_z", "spike_clip_decay", "spike_clip_warmup")  # fmt: skip


def demo_recipe() -> dict[str, Any]:
    """The demo's (``examples/tiny_cpu.yaml``) optimisation settings, as ``simulate`` keywords."""
    import yaml

    section = yaml.safe_load(DEMO.read_text())["trainer"]
    return {k: section[k] for k in RECIPE_FIELDS if k in section}


@torch.no_grad()
def _sample(
    trainer: Trainer, prompts: list[list[int]], length: int, gen: torch.Generator
) -> tuple[list[list[int]], list[list[float]]]:
    """One completion of ``length`` tokens per prompt (all of one length), at temperature 1,
    with its logprobs."""
    ids = torch.tensor(prompts)
    logps = []
    for _ in range(length):
        logits = trainer.model(input_ids=ids, use_cache=False).logits[:, -1].float()
        logp = torch.log_softmax(logits, dim=-1)
        tok = torch.multinomial(logp.exp(), 1, generator=gen)
        logps.append(logp.gather(-1, tok))
        ids = torch.cat([ids, tok], dim=1)
    completions = ids[:, len(prompts[0]) :].tolist()
    return completions, torch.cat(logps, dim=1).tolist()


def simulate(
    model_dir: str | Path,
    *,
    off_policy: str = "decoupled",
    staleness: int,
    steps: int = 30,
    seed: int = 0,
    learning_rate: float = 3e-2,
    prompts: int = 4,
    group: int = 8,
    length: int = 8,
    records: list[dict[str, float]] | None = None,
    **overrides: Any,
) -> list[float]:
    """The mean reward of each step's samples; each step's metrics go to ``records`` if given.
    ``overrides`` are further ``TrainerConfig`` fields. Runs on one thread: the same sums, so
    the same trajectory for a seed, however many cores the machine has."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _simulate(model_dir, off_policy=off_policy, staleness=staleness, steps=steps,
                         seed=seed, learning_rate=learning_rate, prompts=prompts, group=group,
                         length=length, records=records, **overrides)  # fmt: skip
    finally:
        torch.set_num_threads(threads)


def _simulate(
    model_dir: str | Path,
    *,
    off_policy: str,
    staleness: int,
    steps: int,
    seed: int,
    learning_rate: float,
    prompts: int,
    group: int,
    length: int,
    records: list[dict[str, float]] | None,
    **overrides: Any,
) -> list[float]:
    trainer = Trainer(
        model_dir,
        lora=LoraConfig(r=1, alpha=2.0),
        trainer=TrainerConfig(
            learning_rate=learning_rate,
            off_policy=off_policy,  # type: ignore[arg-type]
            max_staleness=staleness,
            samples_per_step=prompts * group,
            token_budget=4096,
            max_steps=steps,
            dtype="float32",
            **overrides,
        ),
        seed=seed,
        device="cpu",
    )
    gen = torch.Generator().manual_seed(seed)
    vocab = trainer.model.config.vocab_size
    prompt_set = torch.randint(DIGITS, vocab, (8, 5), generator=gen).tolist()
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    history: deque[list[torch.Tensor]] = deque(maxlen=staleness + 1)
    rewards = []
    with tempfile.TemporaryDirectory() as tmp:
        for step in range(steps):
            history.append([p.detach().clone() for p in params])
            trainer.save_adapter(Path(tmp) / "v", version=step)  # staleness counts from here
            now = [p.detach().clone() for p in params]
            version = max(0, step - staleness)
            with torch.no_grad():  # sample with the adapter of `version`
                for p, old in zip(params, history[0], strict=True):
                    p.copy_(old)
            trainer.model.eval()
            chosen = [prompt_set[(step * prompts + k) % len(prompt_set)] for k in range(prompts)]
            ids, lps = _sample(trainer, [p for p in chosen for _ in range(group)], length, gen)
            scores = [sum(t < DIGITS for t in c) / len(c) for c in ids]
            samples: list[Sample] = []
            for k, prompt in enumerate(chosen):
                rows = range(k * group, (k + 1) * group)
                advs = group_advantages([scores[i] for i in rows])
                samples += [
                    Sample(prompt_ids=prompt, completion_ids=ids[i], logprobs=lps[i],
                           reward=scores[i], advantage=a, version=version, group_id=f"{step}-{k}")
                    for i, a in zip(rows, advs, strict=True)
                ]  # fmt: skip
            with torch.no_grad():
                for p, cur in zip(params, now, strict=True):
                    p.copy_(cur)
            metrics = trainer.step(samples)
            rewards.append(metrics["reward"])
            if records is not None:
                records.append(metrics)
    return rewards
