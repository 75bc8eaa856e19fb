"""The ``lora`` and ``trainer`` sections of a run's config: the adapter trained and how it is
optimised (loss, batching, schedule, and the cadence of syncs and checkpoints)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from asyncgrpo.config.coerce import check_fields
from asyncgrpo.errors import ConfigError

LrSchedule = Literal["constant", "linear", "cosine"]
OffPolicy = Literal["none", "decoupled", "tis", "mis_token", "mis_sequence"]
Dtype = Literal["auto", "float32", "bfloat16", "float16"]
ScaleRewards = Literal["group", "batch", "none"]
LossType = Literal["dapo", "grpo", "dr_grpo"]
CollapseAction = Literal["off", "warn", "stop", "rollback"]
AuditAction = Literal["off", "warn", "stop"]
UpdateKl = Literal["sampled", "vocab"]

#: The audit's default tolerance (mean |trainer - vLLM| logprob per token, per replica and
#: version) by the trainer's dtype: above how far two correct implementations drift apart at
#: that precision (measured: docs/trainer.md).
AUDIT_TOLERANCE = {"float32": 1e-3, "bfloat16": 0.3, "float16": 0.3}


@dataclass(kw_only=True)
class LoraConfig:
    """The LoRA adapter that is trained and shipped to the replicas (peft ``LoraConfig``)."""

    r: int = 1
    """Rank. Rank 1 matches full fine-tuning for policy-gradient RL."""
    alpha: float = 2.0
    """lora_alpha; the update is scaled by alpha/r."""
    target_modules: str | list[str] = "all-linear"
    """'all-linear' or a list of module names, e.g. [q_proj, v_proj]."""
    dropout: float = 0.0
    """LoRA dropout in [0, 1). Keep 0: with dropout the trainer's logprobs differ from vLLM's
    and `ratio` drifts from 1."""

    def __post_init__(self) -> None:
        check_fields(
            self,
            "lora",
            ge={"r": 1, "dropout": 0},
            le={"r": 512},
            gt={"alpha": 0},
            lt={"dropout": 1},
        )
        if isinstance(self.target_modules, list) and not self.target_modules:
            raise ConfigError("lora.target_modules is empty: use 'all-linear' or list module names")


@dataclass(kw_only=True)
class AuditConfig:
    """The served-policy audit (``trainer.audit``): after a weight sync the trainer recomputes
    the logprobs of a few just-trained samples at the version that sampled them, spread over
    the replicas that served them, and compares them with what vLLM returned: a replica serving
    other weights under the right name is caught within one sync, and named."""

    action: AuditAction = "stop"
    """Above the tolerance: 'stop' ends the run with one line naming the version, the replica
    and the difference; 'warn' logs that line and trains on; 'off': no audit."""
    every: int = 1
    """Audit after every this many weight syncs."""
    samples: int = 8
    """Samples recomputed per audit, taken round-robin over the replicas that served the
    samples trained since the last audit, newest first (one extra forward of their tokens)."""
    tolerance: float | None = None
    """Largest mean |trainer - vLLM| logprob per token accepted, over each replica's audited
    tokens of one version. None: by the trainer's dtype, 1e-3 in float32, 0.3 in bfloat16 and
    float16 (measured: docs/trainer.md). Set it when the replicas serve in a lower precision
    than the trainer."""

    def __post_init__(self) -> None:
        check_fields(self, "trainer.audit", ge={"every": 1, "samples": 1}, gt={"tolerance": 0})

    def tolerance_for(self, dtype: str) -> float:
        """The tolerance in force for a trainer computing in ``dtype`` ('float32', ...)."""
        if self.tolerance is not None:
            return self.tolerance
        return AUDIT_TOLERANCE.get(dtype, AUDIT_TOLERANCE["bfloat16"])


@dataclass(kw_only=True)
class TrainerConfig:
    """Optimisation: loss, batching, schedule, and the cadence of syncs and checkpoints."""

    retired_keys: ClassVar[dict[str, str]] = {
        "tis_cap": "write trainer.off_policy=none trainer.importance_cap=C for the same dual "
        "clip, or keep the default off_policy=decoupled, which bounds stale samples itself",
    }
    """Keys earlier releases accepted, with what replaces them (named in the error)."""

    learning_rate: float = 4e-5
    """AdamW peak learning rate."""
    lr_schedule: LrSchedule = "constant"
    """'constant', 'linear' or 'cosine' decay to 0 at max_steps, after warmup."""
    warmup_steps: int = 0
    """Optimizer steps of linear warm-up from 0 to learning_rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    adam_beta1: float = 0.9
    """AdamW's first-moment decay (momentum), as HF TrainingArguments' adam_beta1."""
    adam_beta2: float = 0.999
    """AdamW's second-moment decay, as HF TrainingArguments' adam_beta2."""
    adam_epsilon: float = 1e-8
    """AdamW's epsilon, as HF TrainingArguments' adam_epsilon. Larger values stop a gradient in a
    direction with little history from being amplified up to 1/sqrt(1 - adam_beta2) times."""
    max_grad_norm: float | None = 1.0
    """Clip the gradient norm to this; None disables clipping."""
    max_update_kl: float | None = None
    """Trust region of one optimizer step in policy space, in nats: after the step, one more
    forward over the step's tokens measures how far it moved the policy (KL(before || after)
    per token, importance-weighted from the sampler's tokens; metric collapse/update_kl); above
    this the update is shrunk towards the old weights by sqrt(max_update_kl / kl). None: off
    (no extra forward)."""
    update_kl: UpdateKl = "sampled"
    """How max_update_kl measures a step. 'sampled': k3 on the step's sampled tokens (one more
    forward). 'vocab': KL(after || before) exactly over the vocabulary at each of the step's
    positions, which also sees the probability a step gives to tokens the policy did not
    sample (two more forwards, vocabulary-sized; docs/trainer.md)."""
    update_kl_history: int = 0
    """With max_update_kl, also measure each step on the rows of this many previous steps
    (other prompts; two more forwards per row) and bound the largest of those KLs: a step can
    move the policy on prompts it did not train on far more than on its own (docs/trainer.md).
    0: the step's own rows only."""
    max_update_rms: float | None = None
    """Bound the optimizer step's root-mean-square change per adapter coordinate, in units of
    the learning rate (Adafactor's update clipping, StableAdamW's RMS bound): AdamW divides a
    gradient spike by a second-moment estimate built from the smaller gradients before it, so
    each coordinate moves up to sqrt((1 - beta2^t) / (1 - beta2)) learning rates at once; a
    longer step is shrunk to this. None: off."""
    spike_clip_z: float | None = None
    """Clip a gradient whose norm is more than this many standard deviations above the run's
    recent norms (an EMA of their mean and variance) to that level, before max_grad_norm and
    AdamW (ZClip's z-score clipping): a spike after converged steps becomes an ordinary step
    instead of AdamW's largest. Steps with a zero gradient are skipped (not counted); metric
    collapse/spike_clip, the factor the gradient was multiplied by. None: off."""
    spike_clip_decay: float = 0.97
    """With spike_clip_z: the EMA factor of the norms' mean and variance (the weight of the
    past; about 1 / (1 - decay) steps remembered)."""
    spike_clip_warmup: int = 5
    """With spike_clip_z: non-zero steps whose norms only seed the statistics before it clips."""
    epsilon: float = 0.2
    """Lower clip range: the ratio is clipped at 1 - epsilon."""
    epsilon_high: float | None = None
    """Upper clip range (1 + epsilon_high); None: same as epsilon. DAPO: 0.28."""
    off_policy: OffPolicy = "decoupled"
    """How the loss corrects for samples drawn by an older policy (stale versions) and for
    vLLM's numerics, with w = pi_trainer / pi_vllm per token. 'decoupled' (decoupled PPO): clip
    around the trainer's own policy, weight min(w, importance_cap). 'tis': the same with a cap
    of 2. 'mis_token': weight w, tokens outside [1/cap, cap] dropped. 'mis_sequence': the same
    on the product of w over each completion. 'none': PPO ratio against vLLM's logprobs (TRL's
    GRPOTrainer), no correction. On fresh samples they coincide; formulas, default caps and
    learning curves: docs/trainer.md."""
    importance_cap: float | None = None
    """Cap of the off_policy weight (> 1). None: the correction's default (decoupled 5, tis 2,
    mis_token 2, mis_sequence 2; none: off). With off_policy=none it is the dual clip: where
    the advantage is negative the ratio is truncated at the cap (TRL's delta); it must then
    exceed 1 + epsilon_high."""
    scale_rewards: ScaleRewards = "group"
    """How advantages are scaled after subtracting the group's mean reward (TRL's
    scale_rewards). 'group': divide by the group's reward std (GRPO); 'batch': by the std of the
    step's rewards (TRL's 'batch'); 'none': no division (Dr. GRPO), so a
    group whose rewards differ by 0.01 teaches 0.01's worth. Use 'none' or 'batch' with a
    continuous reward that saturates: with 'group' a converged group's tiny differences become
    full-size advantages (docs/trainer.md)."""
    loss_type: LossType = "dapo"
    """Loss normalisation (TRL's loss_type). 'dapo': mean over the step's completion tokens
    (token-level: a token weighs the same in a long completion as in a short one); 'grpo': mean
    over each completion's tokens, then over completions (sequence-level: short completions'
    tokens weigh more); 'dr_grpo': sum over tokens / (completions x
    generation.max_completion_length), a constant, no length bias."""
    beta: float = 0.0
    """Coefficient of the KL penalty to the reference policy, the base model (the adapter
    disabled: one more forward per row, no backward), k3 estimate per token as TRL's beta. 0:
    off. A leash against drifting far from the base model; it also slows learning."""
    collapse_action: CollapseAction = "warn"
    """What to do when a run that had reached its reward loses most of the gain
    (collapse/alarm): 'warn' logs one line; 'stop' ends the run after that step; 'rollback'
    restores the adapter and optimizer of the policy that earned the best reward so far (the
    oldest published version among that step's samples, kept in memory) and multiplies the
    learning rate by collapse_lr_factor; 'off': no detection. Metrics collapse/* are
    logged in every case."""
    collapse_window: int = 5
    """Steps in the moving mean of the reward the collapse alarm watches."""
    collapse_drop: float = 0.5
    """The alarm fires when the moving mean falls this share of the way from its best back to
    where the run started (0.5: half the gain lost)."""
    collapse_min_gain: float = 0.1
    """The alarm arms only once the moving mean has risen this much above its start (in reward
    units): below it a dip is noise, not a lost result."""
    collapse_lr_factor: float = 0.5
    """With collapse_action=rollback, the learning rate is multiplied by this at each rollback."""
    samples_per_step: int = 64
    """Completions consumed by one optimizer step."""
    token_budget: int | None = 4096
    """Tokens per packed row (one row per micro-batch). None: no budget; the step's samples are
    split into gradient_accumulation_steps rows instead. Without flash-attention (CPU) a row's
    attention costs its length squared: keep it ~1024."""
    gradient_accumulation_steps: int = 1
    """Only when token_budget is None: number of micro-batches (packed rows) per optimizer step.
    samples_per_step of them gives one sequence per micro-batch."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward: less memory, one more forward."""
    dtype: Dtype = "auto"
    """Base model dtype. 'auto': bfloat16 on CUDA with bf16, else float32."""
    attn_implementation: str | None = None
    """transformers attn_implementation ('sdpa', 'eager', ...); None: flash_attention_2 on CUDA
    when flash-attn is installed, else asyncgrpo_varlen_sdpa (a packed row costs the sum of its
    samples' squares)."""
    peak_flops: float | None = None
    """Peak FLOP/s of one accelerator at the training dtype (e.g. 9.89e14: H100/H200 bf16
    dense), for perf/mfu; None: no MFU metric."""
    fsdp: bool = False
    """With several ranks (torchrun --nproc-per-node N): shard the frozen base model's weights
    over them with FSDP2, so each rank holds 1/N of them. For a base model too large for one
    device; the adapter stays whole on every rank."""
    dp_timeout_s: float = 1800.0
    """With several ranks: how long a rank waits for the others (e.g. while rank 0 gathers
    rollouts, syncs or checkpoints) before the job fails naming it."""
    max_steps: int = 100
    """Optimizer steps to train."""
    max_staleness: int = 4
    """Drop samples generated more than this many adapter versions ago."""
    weight_sync_steps: int = 4
    """Publish a new adapter version every this many steps."""
    save_steps: int = 50
    """Checkpoint every this many steps; 0 disables."""
    audit: AuditConfig = field(default_factory=AuditConfig)
    """The served-policy audit: trainer vs vLLM logprobs of served samples, per replica."""

    def __post_init__(self) -> None:
        check_fields(
            self,
            "trainer",
            gt=dict.fromkeys(
                (
                    "learning_rate",
                    "max_grad_norm",
                    "epsilon",
                    "epsilon_high",
                    "dp_timeout_s",
                    "peak_flops",
                    "collapse_drop",
                    "collapse_lr_factor",
                    "adam_epsilon",
                    "max_update_kl",
                    "max_update_rms",
                    "spike_clip_z",
                    "spike_clip_decay",
                ),
                0,
            ),
            lt={"collapse_lr_factor": 1, "adam_beta1": 1, "adam_beta2": 1, "spike_clip_decay": 1},
            ge={
                "warmup_steps": 0,
                "weight_decay": 0,
                "adam_beta1": 0,
                "adam_beta2": 0,
                "samples_per_step": 1,
                "token_budget": 1,
                "gradient_accumulation_steps": 1,
                "max_steps": 1,
                "max_staleness": 0,
                "weight_sync_steps": 1,
                "save_steps": 0,
                "update_kl_history": 0,
                "beta": 0,
                "collapse_window": 1,
                "spike_clip_warmup": 1,
                "collapse_min_gain": 0,
            },
            le={"collapse_drop": 1},
        )
        cap = self.importance_cap
        if cap is not None and not (math.isfinite(cap) and cap > 1):
            raise ConfigError(
                f"trainer.importance_cap={cap}: must be a number > 1 (the largest importance "
                "weight kept), or None for the correction's default"
            )
        if self.off_policy == "none" and cap is not None and not cap > 1 + self.clip_high:
            raise ConfigError(
                f"trainer.importance_cap={cap}: with off_policy=none it must exceed "
                f"1 + epsilon_high = {1 + self.clip_high:g} (below it the cap would cut the "
                "clipped region); e.g. 3.0, or None to disable"
            )

    @property
    def clip_high(self) -> float:
        """The upper clip range actually used: ``epsilon_high``, or ``epsilon`` when unset."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high
