"""GRPO parity with TRL: one fixed batch through TRL's ``GRPOTrainer`` and through ours.

TRL is the reference implementation nobody here wrote, so it is the oracle. One batch (the tiny
model, a fixed non-zero LoRA, fixed prompts and completions, behaviour logprobs that differ from
the policy so clipping is active, rewards from a real reward function) goes through:

- TRL: ``GRPOTrainer._generate_and_score_completions`` (its reward, advantage and padding code;
  the completions come from TRL's own ``rollout_func`` hook instead of ``generate``), then
  ``compute_loss`` with ``loss_type="dapo"``, ``beta=0``, ``num_iterations=1``, and the
  behaviour logprobs as ``old_per_token_logps``, then ``backward``;
- asyncgrpo: ``RewardScorer`` + ``group_advantages`` (the rollout client's scoring), then
  ``Trainer.step`` (packing into several rows, the loss, backward, accumulation).

Advantages, per-token logprobs and ratios, the loss, the clip fractions and every adapter
gradient agree within 1e-5 in float32, with ``trainer.off_policy=none`` (the ratio against the
behaviour logprobs, TRL's objective; the default ``decoupled`` is asyncgrpo's own). The one loss
option TRL spells differently is the ratio cap: ``off_policy=none`` with
``trainer.importance_cap`` is TRL's ``delta`` (two-sided clipping), checked here too.
A second test runs TRL's own ``train()`` loop (AdamW, schedule, gradient clipping) for three steps
on the batch and compares the adapter with ``Trainer.step``'s after each step.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import random

import anyio
import pytest
import torch

pytest.importorskip("trl")

from asyncgrpo.config.trainer import LoraConfig, TrainerConfig
from asyncgrpo.rollout.rewards import RewardScorer
from asyncgrpo.sample import Sample, group_advantages
from asyncgrpo.trainer.loop import Trainer

PROMPTS = ["count to five", "name a color", "what is two plus two", "pick a number"]
G = 4  # completions per prompt
LORA = {"r": 2, "alpha": 4.0, "target_modules": "all-linear", "dropout": 0.0}
EPSILON, EPSILON_HIGH = 0.2, 0.28
TOL = 1e-5


def even_share(prompts, completions, completion_ids, **kwargs):
    """Share of even token ids; ``None`` (abstain) for a completion of exactly 5 tokens."""
    return [
        None if len(ids) == 5 else sum(t % 2 == 0 for t in ids) / len(ids) for ids in completion_ids
    ]


def _batch(tokenizer, seed: int = 0):
    """Prompt ids, completion ids (some ending in EOS, one group all identical) per sample."""
    rng = random.Random(seed)
    eos = tokenizer.eos_token_id
    special = set(tokenizer.all_special_ids)
    vocab = [t for t in range(len(tokenizer)) if t not in special]
    prompt_ids, completion_ids = [], []
    for p, text in enumerate(PROMPTS):
        ids = tokenizer(text)["input_ids"]
        same = [rng.choice(vocab) for _ in range(7)]
        for i in range(G):
            if p == 2:  # equal rewards: zero advantages, but the tokens still count in the mean
                comp = list(same)
            else:
                comp = [rng.choice(vocab) for _ in range(rng.randint(3, 14))]
                if i % 2 == 0:
                    comp.append(eos)
            if p == 1 and i == 1:
                comp = comp[:5]  # the reward function abstains: NaN reward, advantage 0
            prompt_ids.append(list(ids))
            completion_ids.append(comp)
    return prompt_ids, completion_ids


def _fixed_lora(model_dir, out_dir, seed: int = 1) -> dict[str, torch.Tensor]:
    """A deterministic adapter with non-zero A and B (B = 0 would make every A gradient
    vanish), saved to ``out_dir``; returns its values by parameter name."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model = get_peft_model(base, _peft_config())
    gen = torch.Generator().manual_seed(seed)
    values = {}
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
                values[name] = p.detach().clone()
    model.save_pretrained(str(out_dir))
    return values


def _peft_config():
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(
        r=LORA["r"],
        lora_alpha=LORA["alpha"],
        target_modules=LORA["target_modules"],
        lora_dropout=LORA["dropout"],
        task_type="CAUSAL_LM",
    )


def _load_lora(model, values: dict[str, torch.Tensor]) -> None:
    params = dict(model.named_parameters())
    assert {n for n, p in params.items() if p.requires_grad} == set(values)
    with torch.no_grad():
        for name, value in values.items():
            params[name].copy_(value)


def _trl_trainer(model_dir, tmp_path, lora, prompt_ids, completion_ids, behaviour, **config):
    """TRL's GRPOTrainer on our fixed batch, starting from the adapter ``lora``."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    def rollout_func(prompts, trainer):  # TRL's hook for custom generation: our fixed batch
        assert len(prompts) == len(completion_ids)
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": behaviour}

    args = GRPOConfig(
        output_dir=str(tmp_path / "trl"),
        per_device_train_batch_size=len(completion_ids),
        num_generations=G,
        max_completion_length=max(map(len, completion_ids)),
        beta=0.0,
        num_iterations=1,
        loss_type="dapo",
        scale_rewards="group",
        epsilon=EPSILON,
        epsilon_high=EPSILON_HIGH,
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        model_init_kwargs={"dtype": torch.float32},
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        **config,
    )
    trainer = GRPOTrainer(
        model=str(model_dir),
        reward_funcs=even_share,
        args=args,
        # One prompt row per group and step; rollout_func answers with our batch whatever they are.
        train_dataset=Dataset.from_dict({"prompt": PROMPTS * 4}),
        peft_config=_peft_config(),
        rollout_func=rollout_func,
    )
    _load_lora(trainer.model, lora)
    return trainer


def _trl(model_dir, tmp_path, lora, prompt_ids, completion_ids, behaviour, *, temperature, cap):
    """TRL's advantages, per-token logprobs, loss, metrics and adapter gradients."""
    trainer = _trl_trainer(
        model_dir,
        tmp_path,
        lora,
        prompt_ids,
        completion_ids,
        behaviour,
        temperature=temperature,
        delta=cap,
    )
    model = trainer.model
    model.train()
    # The batch as TRL's sampler hands it over: each prompt G times in a row.
    inputs = trainer._generate_and_score_completions(
        [{"prompt": p} for p in PROMPTS for _ in range(G)]
    )
    mask = inputs["completion_mask"].bool()
    # Off-policy: the behaviour policy's logprobs are the "old" ones the ratio is taken against
    # (TRL's role for them when a generation batch spans several optimizer steps).
    old = torch.zeros(mask.shape)
    for i, lp in enumerate(behaviour):
        old[i, : len(lp)] = torch.tensor(lp)
    inputs["old_per_token_logps"] = old
    trainer.current_gradient_accumulation_steps = 1
    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            model, input_ids, attention, inputs["completion_ids"].size(1)
        )
    loss = trainer.compute_loss(model, inputs)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return {
        "advantages": inputs["advantages"].tolist(),
        "logprobs": [logps[i][mask[i]].tolist() for i in range(len(completion_ids))],
        "loss": float(loss.detach()),
        "grads": grads,
        "metrics": metrics,
    }


def _samples(model_dir, prompt_ids, completion_ids, behaviour, *, temperature=1.0) -> list[Sample]:
    """The batch as the rollout client would queue it: scored and with group advantages."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    scorer = RewardScorer([even_share])
    samples = []
    for g, prompt in enumerate(PROMPTS):
        rows = range(g * G, (g + 1) * G)
        completions = [tokenizer.decode(completion_ids[i], skip_special_tokens=True) for i in rows]
        scores = anyio.run(
            functools.partial(
                scorer.score,
                [prompt] * G,
                completions,
                prompt_ids=[prompt_ids[i] for i in rows],
                completion_ids=[completion_ids[i] for i in rows],
            )
        )
        advantages = group_advantages(scores.rewards)
        for i, reward, adv in zip(rows, scores.rewards, advantages, strict=True):
            samples.append(
                Sample(
                    prompt_ids=prompt_ids[i],
                    completion_ids=completion_ids[i],
                    logprobs=behaviour[i],
                    reward=reward,
                    advantage=adv,
                    version=0,
                    group_id=f"p{g}",
                    temperature=temperature,
                )
            )
    return samples


def _asyncgrpo(model_dir, lora, prompt_ids, completion_ids, behaviour, *, temperature, cap):
    """Our advantages, per-token logprobs, step metrics and adapter gradients."""
    samples = _samples(model_dir, prompt_ids, completion_ids, behaviour, temperature=temperature)
    trainer = Trainer(
        model_dir,
        lora=LoraConfig(**LORA),
        trainer=TrainerConfig(
            learning_rate=1e-3,
            epsilon=EPSILON,
            epsilon_high=EPSILON_HIGH,
            off_policy="none",
            importance_cap=cap,
            max_grad_norm=None,
            token_budget=64,  # several packed rows: the loss is normalised across micro-batches
            dtype="float32",
        ),
        device="cpu",
    )
    _load_lora(trainer.model, lora)
    params = dict(trainer.model.named_parameters())
    grads: dict[str, torch.Tensor] = {}

    def capture(optimizer, args, kwargs):  # the accumulated gradient, before AdamW consumes it
        grads.update({n: p.grad.detach().clone() for n, p in params.items() if p.requires_grad})

    trainer.optimizer.register_step_pre_hook(capture)
    logprobs = trainer.logprobs(samples)
    metrics = trainer.step(samples)
    return {
        "advantages": [s.advantage for s in samples],
        "logprobs": logprobs,
        "loss": metrics["loss"],
        "grads": grads,
        "metrics": metrics,
    }


@pytest.mark.parametrize(
    ("temperature", "cap"),
    [(1.0, None), (0.7, 3.0)],
    ids=["plain", "temperature-and-ratio-cap"],
)
def test_loss_ratios_and_gradients_match_trl(tiny_model, tmp_path, monkeypatch, temperature, cap):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is marked experimental
    from transformers import AutoTokenizer

    from asyncgrpo.testing import ReferencePolicy

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    prompt_ids, completion_ids = _batch(tokenizer)
    lora = _fixed_lora(tiny_model, tmp_path / "adapter")
    # Behaviour logprobs: the policy's own (plain transformers + peft, unpacked) plus up to
    # +-1.5 nats of noise, so ratios spread over ~0.2..4.5 and hit both clip sides (and the cap).
    rng = random.Random(2)
    reference = ReferencePolicy(tiny_model, tmp_path / "adapter")
    behaviour = [
        [lp + rng.uniform(-1.5, 1.5) for lp in reference.logprobs(p, c, temperature=temperature)]
        for p, c in zip(prompt_ids, completion_ids, strict=True)
    ]
    trl = _trl(
        tiny_model,
        tmp_path,
        lora,
        prompt_ids,
        completion_ids,
        behaviour,
        temperature=temperature,
        cap=cap,
    )
    ours = _asyncgrpo(
        tiny_model, lora, prompt_ids, completion_ids, behaviour, temperature=temperature, cap=cap
    )

    # Advantages: group-relative, NaN reward -> 0, equal rewards -> 0.
    assert ours["advantages"] == pytest.approx(trl["advantages"], abs=TOL)  # TRL: float32
    zero = [ours["advantages"][i] for i in (G + 1, *range(2 * G, 3 * G))]
    assert zero == [0.0] * (G + 1)

    # Per-token logprobs (temperature-scaled) and ratios against the behaviour logprobs.
    ratios = {"trl": [], "ours": []}
    for i, lp in enumerate(behaviour):
        assert ours["logprobs"][i] == pytest.approx(trl["logprobs"][i], abs=TOL)
        ratios["trl"] += [math.exp(a - b) for a, b in zip(trl["logprobs"][i], lp, strict=True)]
        ratios["ours"] += [math.exp(a - b) for a, b in zip(ours["logprobs"][i], lp, strict=True)]
    assert ratios["ours"] == pytest.approx(ratios["trl"], rel=TOL)
    assert min(ratios["ours"]) < 1 - EPSILON and max(ratios["ours"]) > 1 + EPSILON_HIGH
    if cap is not None:  # some negative-advantage tokens are capped (a no-op for the others)
        assert ours["metrics"]["off_policy/truncated"] > 0

    # The loss and its clip fractions.
    assert ours["loss"] == pytest.approx(trl["loss"], abs=TOL)
    for key in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
        assert ours["metrics"][key] == pytest.approx(trl["metrics"][key], abs=1e-6), key
    assert ours["metrics"]["clip_ratio/low_mean"] > 0
    assert ours["metrics"]["clip_ratio/high_mean"] > 0
    assert ours["metrics"]["batch/microbatches_per_step"] > 1

    # Every adapter gradient.
    assert set(ours["grads"]) == set(trl["grads"])
    assert any(float(g.abs().max()) > 1e-3 for g in trl["grads"].values())
    for name, g in trl["grads"].items():
        torch.testing.assert_close(ours["grads"][name], g, rtol=0, atol=TOL, msg=name)


def test_optimizer_steps_match_trl_train_loop(tiny_model, tmp_path, monkeypatch):
    """TRL's own ``train()`` (AdamW, constant schedule, gradient clipping, on-policy ratio 1)
    and ``Trainer.step`` move the adapter alike, step after step, on one fixed batch."""
    from transformers import AutoTokenizer, TrainerCallback

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    steps, lr = 3, 3e-2
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    prompt_ids, completion_ids = _batch(tokenizer)
    lora = _fixed_lora(tiny_model, tmp_path / "adapter")
    unused = [[0.0] * len(c) for c in completion_ids]  # on-policy: behaviour = current policy

    trl_after: list[dict[str, torch.Tensor]] = []

    class Snapshot(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            trl_after.append(
                {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
            )

    trl = _trl_trainer(
        tiny_model,
        tmp_path,
        lora,
        prompt_ids,
        completion_ids,
        unused,
        max_steps=steps,
        learning_rate=lr,
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        logging_steps=1,
    )
    trl.add_callback(Snapshot())
    trl.train()

    ours = Trainer(
        tiny_model,
        lora=LoraConfig(**LORA),
        trainer=TrainerConfig(
            learning_rate=lr,
            lr_schedule="constant",
            max_grad_norm=1.0,
            epsilon=EPSILON,
            epsilon_high=EPSILON_HIGH,
            off_policy="none",
            token_budget=64,
            dtype="float32",
        ),
        device="cpu",
    )
    _load_lora(ours.model, lora)
    samples = _samples(tiny_model, prompt_ids, completion_ids, unused)
    clipped = 0
    for k in range(steps):
        on_policy = [
            dataclasses.replace(s, logprobs=lp)
            for s, lp in zip(samples, ours.logprobs(samples), strict=True)
        ]
        clipped += ours.step(on_policy)["grad_norm"] > 1.0
        params = {n: p.detach() for n, p in ours.model.named_parameters() if p.requires_grad}
        moved = max(float((params[n] - lora[n]).abs().max()) for n in params)
        assert moved > 0.9 * lr * (k + 1)  # Adam moves some weights by ~lr per step
        for name, value in trl_after[k].items():
            # AdamW divides by sqrt(v) + 1e-8, so weights whose gradient is ~1e-8 take steps
            # that float32 noise can change by ~1e-5: hence 1e-4, a third of a percent of lr.
            torch.testing.assert_close(params[name], value, rtol=0, atol=1e-4, msg=name)
    assert clipped  # the clipping path ran too
