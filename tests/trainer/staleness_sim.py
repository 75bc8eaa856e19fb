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
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from asyncgrpo.config.trainer import LoraConfig, TrainerConfig
from asyncgrpo.sample import Sample, group_advantages
from asyncgrpo.trainer.loop import Trainer

DIGITS = 12  # token ids 0..11 earn reward
#: Something done to the run at one step, just before ``Trainer.step`` (a forced spike, a broken
#: adapter): it gets the trainer and the step's samples and returns the samples to train on.
Event = Callable[[Trainer, list[Sample]], list[Sample]]
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
    events: Mapping[int, Event] | None = None,
    **overrides: Any,
) -> list[float]:
    """The mean reward of each step's samples; each step's metrics go to ``records`` if given;
    ``events[i]`` happens at step ``i`` (0-based), before the trainer steps. ``overrides`` are
    further ``TrainerConfig`` fields. Runs on one thread: the same sums, so the same trajectory
    for a seed on one machine (float results differ between CPUs, and a run that learns
    amplifies them: a test of a guard constructs the event it guards against with ``events``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _simulate(
            model_dir,
            off_policy=off_policy,
            staleness=staleness,
            steps=steps,
            seed=seed,
            learning_rate=learning_rate,
            prompts=prompts,
            group=group,
            length=length,
            records=records,
            events=events or {},
            **overrides,
        )
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
    events: Mapping[int, Event],
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
                    Sample(
                        prompt_ids=prompt,
                        completion_ids=ids[i],
                        logprobs=lps[i],
                        reward=scores[i],
                        advantage=a,
                        version=version,
                        group_id=f"{step}-{k}",
                    )
                    for i, a in zip(rows, advs, strict=True)
                ]
            with torch.no_grad():
                for p, cur in zip(params, now, strict=True):
                    p.copy_(cur)
            if step in events:
                samples = events[step](trainer, samples)
            metrics = trainer.step(samples)
            rewards.append(metrics["reward"])
            if records is not None:
                records.append(metrics)
    return rewards


def broken_adapter(scale: float, seed: int = 0) -> Event:
    """The adapter comes apart before this step (what a collapse leaves): Gaussian noise of
    standard deviation ``scale`` on every LoRA weight, published as the next version."""

    def event(trainer: Trainer, samples: list[Sample]) -> list[Sample]:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in trainer.params:
                p.add_(torch.randn(p.shape, generator=gen) * scale)
        return samples

    return event


def forced_spike(factor: float) -> Event:
    """This step moves the adapter ``factor`` times as far as the optimizer says (what AdamW
    does to a gradient in a direction with little history, up to 1/sqrt(1 - adam_beta2)): the
    event the step's bounds (``max_update_rms``, ``max_update_kl``) exist for. They apply after
    the optimizer's step, so they see the spike."""

    def event(trainer: Trainer, samples: list[Sample]) -> list[Sample]:
        optimizer_step = trainer.optimizer.step

        def spiked(*args: Any, **kwargs: Any) -> Any:
            before = [p.detach().clone() for p in trainer.params]
            out = optimizer_step(*args, **kwargs)
            with torch.no_grad():
                for p, b in zip(trainer.params, before, strict=True):
                    p.copy_(b + factor * (p - b))
            trainer.optimizer.step = optimizer_step  # this step only
            return out

        trainer.optimizer.step = spiked  # type: ignore[method-assign]
        return samples

    return event


def random_spike(rms: float, seed: int = 0) -> Event:
    """This step moves every adapter coordinate, on top of the optimizer's step, by Gaussian
    noise of ``rms`` learning rates: what AdamW does to a gradient in directions with little
    history after a converged run's steps of near-zero gradient (up to
    sqrt((1 - beta2^t) / (1 - beta2)) learning rates a coordinate, 31.6 at adam_beta2 0.999),
    in directions the reward never asked for. The step's bounds apply after the optimizer's
    step, so they see it."""

    def event(trainer: Trainer, samples: list[Sample]) -> list[Sample]:
        optimizer_step = trainer.optimizer.step

        def spiked(*args: Any, **kwargs: Any) -> Any:
            out = optimizer_step(*args, **kwargs)
            gen = torch.Generator().manual_seed(seed)
            lr = trainer.optimizer.param_groups[0]["lr"]
            with torch.no_grad():
                for p in trainer.params:
                    p.add_(torch.randn(p.shape, generator=gen) * rms * lr)
            trainer.optimizer.step = optimizer_step  # this step only
            return out

        trainer.optimizer.step = spiked  # type: ignore[method-assign]
        return samples

    return event


class When:
    """An event once the run reaches a reward: ``event`` at ``count`` consecutive steps, the first
    ``after`` steps after the step whose samples' ``window``-step mean reward first reached
    ``reach``. One ``When`` for every step (``dict.fromkeys(range(steps), when)``): where a run
    takes off or converges differs between machines, the event is placed by what it did."""

    def __init__(
        self, event: Event, *, reach: float, window: int = 1, after: int = 0, count: int = 1
    ) -> None:
        self.event, self.reach, self.window, self.after, self.count = (
            event,
            reach,
            window,
            after,
            count,
        )
        self.rewards: list[float] = []
        self.steps: list[int] = []  #: the steps (0-based) it happened at
        self.reached: int | None = None

    def __call__(self, trainer: Trainer, samples: list[Sample]) -> list[Sample]:
        step = len(self.rewards)
        self.rewards.append(sum(s.reward for s in samples) / len(samples))
        recent = self.rewards[-self.window :]
        if self.reached is None and len(recent) == self.window:
            if sum(recent) / self.window >= self.reach:
                self.reached = step
        start = None if self.reached is None else self.reached + self.after
        if start is not None and start <= step < start + self.count:
            self.steps.append(step)
            return self.event(trainer, samples)
        return samples
