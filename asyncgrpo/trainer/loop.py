"""The trainer: one optimizer step at a time over scored samples, read top to bottom.

``Trainer.step(samples)`` does, in order: pack the samples into token-budget rows, run one
micro-step (forward, loss, backward) per row, clip the gradient, take the AdamW step, advance
the learning-rate schedule, and return the step's metrics. Everything around it (waiting for
rollouts, dropping stale samples, publishing adapter versions, checkpoint upload, logging)
belongs to the caller (``run_training``), so this class knows nothing about HTTP or storage.

Data parallelism (torchrun, ``dp``): rank 0 calls ``step`` with the whole step's samples and
the trainer scatters token-balanced shards to the ranks (:mod:`asyncgrpo.trainer.distributed`);
the other ranks sit in ``follow``. The completion-token count is summed over the ranks before
the micro-steps, the adapter gradients after them, then every rank clips and steps identically.
Rank 0 alone saves the adapter and checkpoints: every rank holds the whole adapter.

Off-policy correction (``trainer.off_policy``, :mod:`asyncgrpo.trainer.loss`): every step is
exactly one optimizer step over a batch no other step sees, so the proximal policy of the
decoupled objective is the current forward pass, detached. A token's staleness is the trainer's
newest published version minus the version that sampled it; the trainer learns its versions
from ``save_adapter(path, version=N)`` (the run publishes through it), and the tokens of that
version count as on-policy (``ratio``) while the weights have not moved since.

Collapse guard (``trainer.collapse_action``, :mod:`asyncgrpo.trainer.collapse`): rank 0 feeds
each step's mean reward to the alarm; on a collapse it logs one line and, as configured, asks
the caller to stop (``stop_requested``) or restores the best step's adapter and optimizer state
from memory at a lower learning rate (``rollback``).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import os
import random
import time
import warnings
from collections import defaultdict, deque
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from asyncgrpo.errors import ConfigError
from asyncgrpo.sample import Sample, SampleBounds, group_stats, scale_advantages
from asyncgrpo.trainer.collapse import CollapseDetector
from asyncgrpo.trainer.flops import ModelShape, step_flops
from asyncgrpo.trainer.loss import (
    Objective,
    add_stats,
    finalize_stats,
    grpo_loss,
    stat_keys,
    token_normaliser,
)
from asyncgrpo.trainer.model import (
    context_length,
    default_device,
    load_adapter_weights,
    load_policy,
    row_logprobs,
    row_vocab_logprobs,
)
from asyncgrpo.trainer.model import save_adapter as _save_adapter
from asyncgrpo.trainer.packing import PackedRow, build_row, pack_samples
from asyncgrpo.trainer.spike_clip import SpikeClip
from asyncgrpo.trainer.trust_region import global_norm, kl_scale, shrink, token_kl, vocab_kl

if TYPE_CHECKING:
    from asyncgrpo.config.training import TrainingConfig
    from asyncgrpo.trainer.config import LoraConfig, TrainerConfig
    from asyncgrpo.trainer.distributed import DataParallel

logger = logging.getLogger(__name__)

STATE_FILE = "trainer_state.pt"
ADAPTER_DIR = "adapter"
_STATE_FORMAT = 1


def lr_factor(step: int, *, schedule: str, warmup_steps: int, max_steps: int) -> float:
    """Multiplier of the peak learning rate for optimizer step ``step`` (0-based).

    Warm-up ramps linearly to 1 over ``warmup_steps`` (step 0 already gets ``1/(warmup+1)``, so
    no step is wasted at lr 0); then ``constant`` stays at 1, ``linear`` and ``cosine`` decay
    towards 0 at ``max_steps``.
    """
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    if schedule == "linear":
        return 1.0 - progress
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown lr schedule {schedule!r}")


def sample_metrics(samples: Sequence[Sample]) -> dict[str, float]:
    """Reward and length statistics of a step's samples (NaN rewards skipped)."""
    rewards = [s.reward for s in samples]
    mean, _ = group_stats(rewards)
    groups: dict[str, list[float]] = defaultdict(list)
    per_fn: dict[str, list[float]] = defaultdict(list)
    for s in samples:
        groups[s.group_id].append(s.reward)
        for name, value in s.rewards.items():
            per_fn[name].append(value)
    stds = [std for _, std in map(group_stats, groups.values()) if not math.isnan(std)]
    advs = [abs(s.advantage) for s in samples]
    out = {
        "reward": mean,
        "reward_std": sum(stds) / len(stds) if stds else math.nan,
        "advantages/abs_mean": sum(advs) / len(advs),
        "advantages/abs_max": max(advs),
        # the policy's tokens: an episode's environment text is not the model's length
        "completions/mean_length": sum(s.num_policy_tokens for s in samples) / len(samples),
    }
    for name, values in sorted(per_fn.items()):
        out[f"rewards/{name}"] = group_stats([float(v) for v in values])[0]
    return out


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory since the step began: allocated tensors on CUDA; on CPU the process's peak
    resident set so far (the OS keeps no per-step peak)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


@dataclasses.dataclass
class _Batch:
    """One step's packed rows and counts (all ranks' counts when data-parallel)."""

    rows: list[PackedRow]
    num_tokens: int  #: completion tokens: the loss's normaliser
    total_tokens: int
    num_rows: int
    row_tokens_max: int
    num_sequences: int
    longest: int  #: the longest sample's policy tokens
    micro_steps: int  #: forward/backward passes (FSDP: equal on every rank)
    #: each micro-step's token logprobs before the update (detached): the KL trust region's base
    logps: list[torch.Tensor] = dataclasses.field(default_factory=list)


class Trainer:
    """A LoRA policy, its AdamW optimizer and schedule, and the GRPO step."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        lora: LoraConfig,
        trainer: TrainerConfig,
        seed: int = 0,
        device: torch.device | str | None = None,
        dp: DataParallel | None = None,
        max_completion_length: int | None = None,
    ) -> None:
        self.config = trainer
        self.dp = dp
        if trainer.collapse_action == "rollback" and dp is not None:
            raise ConfigError(
                "trainer.collapse_action=rollback restores the adapter in one process only; "
                "with several ranks use 'warn' or 'stop'"
            )
        #: the completion-length bound of loss_type=dr_grpo (None: each step's longest)
        self.max_completion_length = max_completion_length
        if device is None:
            device = dp.device() if dp is not None else default_device()
        self.device = torch.device(device)
        fsdp = dp is not None and trainer.fsdp
        if trainer.fsdp and dp is None:
            logger.info("trainer.fsdp has no effect in a single process (start with torchrun)")
        torch.manual_seed(seed)  # the LoRA init (lora_A) draws from torch's RNG
        random.seed(seed)
        self.model = load_policy(
            model_path,
            lora,
            dtype=trainer.dtype,
            # with FSDP the whole base model never lands on the device: fully_shard moves shards
            device=torch.device("cpu") if fsdp else self.device,
            gradient_checkpointing=trainer.gradient_checkpointing,
            attn_implementation=trainer.attn_implementation,
        )
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        if dp is not None:
            dp.broadcast_parameters(self.params)
        if fsdp:
            from asyncgrpo.trainer.distributed import shard_base_model

            shard_base_model(self.model, self.params)
            for p in self.params:  # the adapter is not FSDP's: move it ourselves
                p.data = p.data.to(self.device)
        self.shape = ModelShape.from_config(self.model.config)
        self.optimizer, self.scheduler = _optimizer(self.params, trainer)
        self._base_lrs = list(self.scheduler.base_lrs)
        self.step_count = 0  # optimizer steps taken
        self.objective = Objective.from_config(trainer)
        self.buckets = trainer.max_staleness + 1  # staleness metrics: 0 .. max_staleness
        self._published: tuple[int, int] | None = None  # (newest version, step it was saved at)
        self.collapse = CollapseDetector(
            window=trainer.collapse_window,
            drop=trainer.collapse_drop,
            min_gain=trainer.collapse_min_gain,
        )
        #: set when collapse_action=stop fired: the caller ends the run after this step
        self.stop_requested = False
        self.rollbacks = 0
        self._best_state: dict[str, Any] | None = None  # collapse_action=rollback's target
        self._best_step = 0
        #: collapse_action=rollback: the state each recent published version was saved with
        self._snapshots: dict[int, tuple[int, dict[str, Any]]] = {}
        #: max_update_kl's other prompts: the rows of the last update_kl_history steps
        self._kl_history: deque[tuple[list[PackedRow], int]] = deque(
            maxlen=trainer.update_kl_history
        )
        #: spike_clip_z's running statistics of the gradient norm (None: off)
        self.spike_clip: SpikeClip | None = None
        if trainer.spike_clip_z is not None:
            self.spike_clip = SpikeClip(
                trainer.spike_clip_z,
                decay=trainer.spike_clip_decay,
                warmup=trainer.spike_clip_warmup,
            )
        self._spike_factor = 1.0  # the last step's spike clip factor

    @classmethod
    def from_config(
        cls,
        cfg: TrainingConfig,
        *,
        device: torch.device | str | None = None,
        dp: DataParallel | None = None,
    ) -> Trainer:
        return cls(
            cfg.model,
            lora=cfg.lora,
            trainer=cfg.trainer,
            seed=cfg.seed,
            device=device,
            dp=dp,
            max_completion_length=cfg.generation.max_completion_length,
        )

    def sample_bounds(self, max_model_len: int | None = None) -> SampleBounds:
        """What this model can train on: token ids below its input embedding's rows, samples
        no longer than its context (``max_model_len``: the replicas' setting, if any)."""
        vocab = self.model.get_input_embeddings().num_embeddings
        return SampleBounds(vocab, context_length(self.model.config, max_model_len))

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -----------------------------------------------------------------------------------------
    def step(self, samples: Sequence[Sample]) -> dict[str, float]:
        """One optimizer step over ``samples``; returns its metrics.

        With several ranks, only rank 0 calls this, with the whole step's samples; each rank
        (rank 0 included) trains on its token-balanced shard while the others are in ``follow``.
        """
        if not samples:
            raise ValueError("Trainer.step needs at least one sample")
        samples = self.scaled(samples)
        clock = self.policy_clock(samples)
        if self.dp is None:
            metrics = self._step(samples, samples, clock)
        else:
            shard = self.dp.scatter(samples, clock)
            assert shard is not None
            metrics = self._step(shard[0], samples, shard[1])
        metrics.update(self._watch(metrics, samples))
        return metrics

    def scaled(self, samples: Sequence[Sample]) -> list[Sample]:
        """``samples`` with advantages under ``trainer.scale_rewards`` (the rollout scaled them
        per group; 'batch' and 'none' rescale them here, from their rewards)."""
        scale = self.config.scale_rewards
        if scale == "group":
            return list(samples)
        advs = scale_advantages([s.reward for s in samples], [s.advantage for s in samples],
                                [s.group_id for s in samples], scale)  # fmt: skip
        return [dataclasses.replace(s, advantage=a) for s, a in zip(samples, advs, strict=True)]

    def _watch(self, metrics: dict[str, float], samples: Sequence[Sample]) -> dict[str, float]:
        """The collapse alarm on this step's reward, and its action (rank 0)."""
        cfg = self.config
        out = {
            "collapse/entropy": metrics.get("entropy", math.nan),
            "collapse/kl_sampler": metrics.get("kl", math.nan),
            "collapse/weight_max": metrics.get("off_policy/weight_max", math.nan),
        }
        if cfg.collapse_action == "off" or "reward" not in metrics:
            return out
        verdict = self.collapse.update(metrics["reward"])
        out["collapse/reward_mean"] = verdict.mean
        out["collapse/reward_best"] = verdict.best
        out["collapse/alarm"] = float(verdict.alarm)
        if cfg.collapse_action == "rollback":
            if verdict.new_best:
                self._best_step, self._best_state = self._scoring_state(samples)
            out["collapse/rollbacks"] = float(self.rollbacks + verdict.alarm)
        if not verdict.alarm:
            return out
        what = {"warn": "no action (trainer.collapse_action=warn)",
                "stop": "stopping the run (trainer.collapse_action=stop)",
                "rollback": "rolling back"}[cfg.collapse_action]  # fmt: skip
        if cfg.collapse_action == "rollback" and self._best_state is not None:
            what = self._rollback()
        elif cfg.collapse_action == "stop":
            self.stop_requested = True
        logger.warning(
            "collapse alarm at step %d: reward mean %.3g over %d steps, best %.3g, start %.3g; "
            "entropy %.3g, kl to sampler %.3g, max importance weight %.3g, update norm %.3g; %s",
            self.step_count, verdict.mean, cfg.collapse_window, verdict.best, verdict.start,
            out["collapse/entropy"], out["collapse/kl_sampler"], out["collapse/weight_max"],
            metrics.get("collapse/update_norm", math.nan), what,
        )  # fmt: skip
        return out

    def _scoring_state(self, samples: Sequence[Sample]) -> tuple[int, dict[str, Any]]:
        """The step and state of the policy that earned these samples' rewards: the oldest
        version among them, as it was published (``save_adapter(..., version=N)``). With stale
        samples a high reward is the old policy's: the current one may already be breaking
        while they still score well. Unknown versions (never published here): the current."""
        oldest = min(s.version for s in samples)
        if oldest in self._snapshots:
            step, state = self._snapshots[oldest]
            return step, _copy_state(state)
        return self.step_count, _copy_state(self.state_dict())

    def _rollback(self) -> str:
        """Restore the best step's adapter and optimizer, keep the step count, lower the lr."""
        assert self._best_state is not None
        step = self.step_count
        state = _copy_state(self._best_state)
        factor = self.config.collapse_lr_factor ** (self.rollbacks + 1)
        params = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(state["adapter"][name].to(p.device, p.dtype))
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.base_lrs = [lr * factor for lr in self._base_lrs]
        for group, lr in zip(self.optimizer.param_groups, self.scheduler.base_lrs, strict=True):
            group["lr"] = lr * self.scheduler.lr_lambdas[0](step)
        self.rollbacks += 1
        self.collapse.forget_recent()
        return (f"rolled back to the adapter of step {self._best_step}, learning rate x{factor:g} "
                "(trainer.collapse_action=rollback)")  # fmt: skip

    def policy_clock(self, samples: Sequence[Sample]) -> tuple[int, bool]:
        """The version staleness is counted from, and whether the weights still equal it.

        That is the newest version published through ``save_adapter(..., version=N)`` and
        whether no step was taken since; a trainer that never published counts from the
        newest version among ``samples``' tokens and takes its weights to be that version's.
        """
        if self._published is None:
            return max(max(s.versions or [s.version]) for s in samples), True
        version, at_step = self._published
        return version, at_step == self.step_count

    def follow(self) -> int:
        """Ranks other than 0: train on the shards rank 0 scatters until it calls ``release``.

        Returns the number of steps taken.
        """
        if self.dp is None or self.dp.is_main:
            raise RuntimeError("Trainer.follow is for data-parallel ranks other than 0")
        steps = 0
        while (shard := self.dp.scatter(None)) is not None:
            self._step(shard[0], None, shard[1])
            steps += 1
        return steps

    def release(self) -> None:
        """Rank 0, at the end of training: let the other ranks' ``follow`` return."""
        if self.dp is not None and self.dp.is_main:
            self.dp.scatter(None)

    def _step(
        self,
        samples: Sequence[Sample],
        step_samples: Sequence[Sample] | None,
        clock: tuple[int, bool],
    ) -> dict[str, float]:
        """Train on this rank's ``samples``; ``step_samples`` are all ranks' (rank 0 only);
        ``clock`` is rank 0's ``policy_clock``."""
        self._sync()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        t_step = time.perf_counter()
        batch = self._pack(samples)
        lr = self.scheduler.get_last_lr()[0]
        loss_total, sums, fwd_s, fwd_bwd_s = self._backward(batch, clock)
        grad_norm, update_norm, param_norm, update_scale, update_kl = self._update(batch)
        self._sync()
        step_s = time.perf_counter() - t_step

        metrics = {
            "loss": loss_total,
            "grad_norm": grad_norm,
            "learning_rate": lr,
            **finalize_stats(sums, self.buckets),
            "collapse/update_norm": update_norm,
            "collapse/adapter_norm": param_norm,
            "collapse/update_scale": update_scale,
            "collapse/update_kl": update_kl,
            **({} if self.spike_clip is None else {"collapse/spike_clip": self._spike_factor}),
            "batch/tokens": float(batch.total_tokens),
            "batch/completion_tokens": float(batch.num_tokens),
            "batch/microbatches_per_step": float(batch.num_rows),
            "batch/row_tokens_max": float(batch.row_tokens_max),
            "perf/fwd_s": fwd_s,
            "perf/fwd_bwd_s": fwd_bwd_s,
            "perf/train_step_s": step_s,
            "perf/tokens_per_s": batch.total_tokens / fwd_bwd_s if fwd_bwd_s > 0 else math.nan,
            "perf/peak_mem_gib": peak_memory_gib(self.device),
        }
        if step_samples is not None:
            metrics.update(sample_metrics(step_samples))
            metrics["batch/samples"] = float(len(step_samples))
            metrics["batch/samples_per_row"] = len(step_samples) / batch.num_rows
        if self.dp is not None:
            metrics["batch/ranks"] = float(self.dp.world_size)
        if self.config.peak_flops is not None and fwd_bwd_s > 0:
            # This rank's rows over this rank's time: MFU per device, also with several ranks.
            rows = batch.rows
            local = sum(row.num_completion_tokens for row in rows)
            flops = step_flops(self.shape, (n for row in rows for n in row.seq_lens), local)
            metrics["perf/mfu"] = flops / fwd_bwd_s / self.config.peak_flops
        return metrics

    def _pack(self, samples: Sequence[Sample]) -> _Batch:
        """Token-budget rows (or ``gradient_accumulation_steps`` rows without a budget), with
        the step's counts: all ranks' counts when data-parallel."""
        cfg = self.config
        rows = pack_samples(
            samples,
            token_budget=cfg.token_budget,
            num_rows=None if cfg.token_budget is not None else cfg.gradient_accumulation_steps,
        )
        batch = _Batch(
            rows=rows,
            num_tokens=sum(row.num_completion_tokens for row in rows),
            total_tokens=sum(row.num_tokens for row in rows),
            num_rows=len(rows),
            row_tokens_max=max((row.num_tokens for row in rows), default=0),
            num_sequences=len(samples),
            longest=max((s.num_policy_tokens for s in samples), default=0),
            micro_steps=len(rows),
        )
        if self.dp is not None:  # the step's counts are all ranks' counts
            counts = self.dp.gather_counts(
                [
                    batch.num_tokens,
                    batch.total_tokens,
                    batch.num_rows,
                    batch.num_sequences,
                    batch.row_tokens_max,
                    batch.longest,
                ]
            )
            batch.num_tokens, batch.total_tokens, batch.num_rows, batch.num_sequences = (
                int(v) for v in counts[:, :4].sum(0)
            )
            batch.row_tokens_max, batch.longest = (int(v) for v in counts[:, 4:].max(0).values)
            if cfg.fsdp:  # FSDP gathers weights in every forward: equal pass counts everywhere
                batch.micro_steps = int(counts[:, 2].max())
        if batch.num_tokens == 0:
            raise ValueError("Trainer.step: the samples hold no completion tokens")
        return batch

    def _backward(
        self, batch: _Batch, clock: tuple[int, bool]
    ) -> tuple[float, dict[str, float], float, float]:
        """Forward and backward of every micro-step, the loss normalised by the step's
        completion tokens: (loss, metric sums, forward seconds, forward+backward seconds), all
        ranks' sums when data-parallel."""
        self.model.train()
        sums: dict[str, float] = {}
        loss_total = fwd_s = fwd_bwd_s = 0.0
        rows = batch.rows
        for i in range(batch.micro_steps):
            row, weight = (rows[i], 1.0) if i < len(rows) else (_padding_row(rows), 0.0)
            self._sync()
            t0 = time.perf_counter()
            loss, part, t1 = self._row_loss(row, batch, clock)
            (loss * weight).backward()
            self._sync()
            t2 = time.perf_counter()
            fwd_s += t1 - t0
            fwd_bwd_s += t2 - t0
            if weight:
                loss_total += float(loss.detach())
                add_stats(sums, part)
        if self.dp is not None:  # gradient of the whole step; metric sums of all ranks
            self.dp.sum_gradients(self.params)
            keys = stat_keys(self.buckets)
            summed = [k for k in keys if not k.endswith("_max")]
            maxed = [k for k in keys if k.endswith("_max")]
            loss_total, *values = self.dp.sum([loss_total, *(sums.get(k, 0.0) for k in summed)])
            highest = self.dp.max([sums.get(k, -math.inf) for k in maxed])
            sums = dict(zip(summed + maxed, values + highest, strict=True))
        return loss_total, sums, fwd_s, fwd_bwd_s

    def _row_loss(
        self, row: PackedRow, batch: _Batch, clock: tuple[int, bool]
    ) -> tuple[torch.Tensor, dict[str, Any], float]:
        """One row's GRPO loss and its metric parts; the third value is the time the policy's
        forward ended (``perf_counter``)."""
        cfg = self.config
        logp, entropy = row_logprobs(self.model, row)
        self._sync()
        forward_end = time.perf_counter()
        batch.logps.append(logp.detach())
        mask = row.completion_mask
        device = logp.device
        staleness = clock[0] - row.versions[mask]
        sequence_ids = row.sequence_ids[mask].to(device)
        normaliser = None
        if cfg.loss_type != "dapo":
            per_sequence = torch.bincount(sequence_ids, minlength=len(row.seq_lens))
            normaliser = token_normaliser(
                cfg.loss_type,
                per_sequence[sequence_ids],
                num_tokens=batch.num_tokens,
                num_sequences=batch.num_sequences,
                max_length=max(self.max_completion_length or 0, batch.longest),
            )
        reference = None
        if cfg.beta > 0:  # the base model: the same forward with the adapter disabled
            with torch.no_grad(), self.model.disable_adapter():
                reference, _ = row_logprobs(self.model, row, with_entropy=False)
        loss, part = grpo_loss(
            logp,
            row.behaviour_logprobs[mask].to(device),
            row.advantages[mask].to(device),
            self.objective,
            num_tokens=batch.num_tokens,
            staleness=staleness,
            on_policy=(staleness == 0) & clock[1],
            buckets=self.buckets,
            sequence_ids=sequence_ids,
            entropy=entropy,
            reference_logp=reference,
            normaliser=normaliser,
        )
        return loss, part, forward_end

    def _update(self, batch: _Batch) -> tuple[float, float, float, float, float]:
        """Clip, the optimizer step and schedule (a non-finite gradient skips the update), then
        the bound on the step's RMS per coordinate (``trainer.max_update_rms``) and the trust
        region (``trainer.max_update_kl``): (gradient norm, update norm, adapter norm, the
        factor the two shortened the step by, the step's KL before the trust region)."""
        cfg = self.config
        grad_norm = self._clip()
        before = [p.detach().clone() for p in self.params]
        lr = self.optimizer.param_groups[0]["lr"]  # this step's (the schedule advances below)
        if math.isfinite(grad_norm):
            self.optimizer.step()
            self.scheduler.step()
        else:
            logger.warning(
                "step %d: gradient norm is %s; update skipped", self.step_count, grad_norm
            )
            with warnings.catch_warnings():  # the schedule still advances with the step count
                warnings.simplefilter("ignore", UserWarning)
                self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        kl, scale = math.nan, 1.0
        if cfg.max_update_rms is not None and math.isfinite(grad_norm):
            delta = [p.detach() - b for p, b in zip(self.params, before, strict=True)]
            count = sum(d.numel() for d in delta)
            rms = global_norm(delta) / math.sqrt(count) / lr if count and lr > 0 else 0.0
            if rms > cfg.max_update_rms:
                scale = cfg.max_update_rms / rms
                shrink(self.params, before, scale)
        if cfg.max_update_kl is not None:
            kl = self._update_kl(batch, before)
            kl_factor = kl_scale(kl, cfg.max_update_kl)
            shrink(self.params, before, kl_factor)
            scale *= kl_factor
        update_norm = global_norm(
            [p.detach() - b for p, b in zip(self.params, before, strict=True)]
        )
        param_norm = global_norm([p.detach() for p in self.params])
        self.step_count += 1
        return grad_norm, update_norm, param_norm, scale, kl

    def _clip(self) -> float:
        """Clip the gradient in place to ``trainer.max_grad_norm`` and, with
        ``trainer.spike_clip_z``, to the level the run's recent norms allow; returns its norm
        before clipping (the factor of the spike clip goes to ``_spike_factor``)."""
        max_norm = self.config.max_grad_norm
        grad_norm: float | None = None
        if self.spike_clip is not None:
            grad_norm = _grad_norm(self.params)
            self._spike_factor = self.spike_clip.factor(grad_norm)
            if self._spike_factor < 1.0:
                level = grad_norm * self._spike_factor
                max_norm = level if max_norm is None else min(max_norm, level)
        if max_norm is not None:
            return float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
        return _grad_norm(self.params) if grad_norm is None else grad_norm

    @torch.no_grad()
    def _update_kl(self, batch: _Batch, before: Sequence[torch.Tensor]) -> float:
        """How far the step moved the policy: the KL on the step's own rows and, with
        ``trainer.update_kl_history``, on those of the steps before it (prompts this step did
        not train on), the largest of them."""
        kl = self._rows_kl(batch.rows, batch.micro_steps, batch.logps, before)
        for rows, micro_steps in self._kl_history:
            kl = max(kl, self._rows_kl(rows, micro_steps, None, before))
        if self._kl_history.maxlen:
            self._kl_history.append((batch.rows, batch.micro_steps))
        return kl

    def _rows_kl(
        self,
        rows: Sequence[PackedRow],
        micro_steps: int,
        old_logps: Sequence[torch.Tensor] | None,
        before: Sequence[torch.Tensor],
    ) -> float:
        """KL(before || after) over ``rows``' tokens (``trainer.update_kl``): per token the k3
        of the sampled token, or the vocabulary KL(after || before) at its position, weighted
        by pi_before / pi_sampler of the sampled token with the weights normalised
        (self-normalised importance sampling: the tokens came from the sampler, and a token the
        policy had all but ruled out would otherwise dominate). ``old_logps``: pi_before of the
        sampled tokens when known (the step's own rows); otherwise a second forward at the old
        weights gives them. Every rank's tokens."""
        vocab = self.config.update_kl == "vocab"
        num = den = 0.0
        for i in range(micro_steps):
            row = rows[i] if i < len(rows) else _padding_row(rows)
            measure = row_vocab_logprobs if vocab else _token_logprobs
            new = measure(self.model, row)
            if vocab or old_logps is None:
                after = _swap(self.params, before)
                old_measure = measure(self.model, row)
                _swap(self.params, after)
            if i >= len(rows):
                continue
            if vocab:
                kl = vocab_kl(old_measure.double(), new.double())[1]
                targets = row.input_ids[row.completion_mask].to(new.device)
                old_tok = old_measure.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
            else:
                old_tok = old_measure if old_logps is None else old_logps[i]
                kl = token_kl(new.double(), old_tok.double())
            old_tok = old_logps[i] if old_logps is not None else old_tok
            behaviour = row.behaviour_logprobs[row.completion_mask].to(new.device).double()
            weight = torch.exp(old_tok.double() - behaviour)
            num += float((weight * kl).sum())
            den += float(weight.sum())
        if self.dp is not None:
            num, den = self.dp.sum([num, den])
        return num / den if den > 0 else 0.0

    # -----------------------------------------------------------------------------------------
    @torch.no_grad()
    def logprobs(self, samples: Sequence[Sample]) -> list[list[float]]:
        """The current policy's per-token logprobs of each sample's completion (eval mode).

        For checks, e.g. that vLLM served exactly this policy: compare with ``Sample.logprobs``.
        Aligned with ``completion_ids``; environment tokens are not scored and hold 0.0, as in
        ``Sample.logprobs``.
        With ``trainer.fsdp`` over several ranks every rank must call it (a forward gathers the
        sharded weights from all of them).
        """
        was_training = self.model.training
        self.model.eval()
        try:
            out: list[list[float]] = [[] for _ in samples]
            for row in pack_samples(samples, token_budget=self.config.token_budget):
                logp, _ = row_logprobs(self.model, row, with_entropy=False)
                logp = logp.cpu().tolist()
                scored = iter(logp)  # the row's policy tokens, sample after sample
                for i in row.sample_indices:
                    out[i] = [next(scored) if m else 0.0 for m in samples[i].policy_mask()]
            return out
        finally:
            self.model.train(was_training)

    @torch.no_grad()
    def logprobs_at(self, samples: Sequence[Sample], adapter_dir: str | Path) -> list[list[float]]:
        """:meth:`logprobs` under the adapter saved in ``adapter_dir`` (a published version):
        its weights are copied in for the forward and the current ones copied back, bit for
        bit, even if the forward fails. The served-policy audit recomputes a version with it."""
        current = [p.detach().clone() for p in self.params]
        try:
            load_adapter_weights(self.model, adapter_dir)
            return self.logprobs(samples)
        finally:
            for p, saved in zip(self.params, current, strict=True):
                p.copy_(saved)

    @property
    def dtype_name(self) -> str:
        """The base model's dtype as a config spells it ('float32', 'bfloat16', ...)."""
        return str(getattr(self.model, "dtype", torch.float32)).removeprefix("torch.")

    def save_adapter(self, path: str | Path, *, version: int | None = None) -> Path:
        """Write the adapter (safetensors + adapter_config.json) into directory ``path``.

        ``version``: the adapter version these weights are published as; the trainer counts
        each sample's staleness from the newest one (``policy_clock``).
        """
        out = _save_adapter(self.model, path)
        if version is not None:
            self._published = (version, self.step_count)
            if self.config.collapse_action == "rollback":  # the versions samples may come from
                self._snapshots[version] = (self.step_count, _copy_state(self.state_dict()))
                for old in sorted(self._snapshots)[: -(self.config.max_staleness + 1)]:
                    del self._snapshots[old]
        return out

    # -- checkpointing ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue bit-for-bit: adapter, optimizer, schedule, step, RNG."""
        rng: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        extra = {} if self.spike_clip is None else {"spike_clip": self.spike_clip.state_dict()}
        return {
            "format": _STATE_FORMAT,
            **extra,
            "step": self.step_count,
            "adapter": {
                name: p.detach().cpu().clone()
                for name, p in self.model.named_parameters()
                if p.requires_grad
            },
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng": rng,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("format") != _STATE_FORMAT:
            raise ValueError(f"unsupported trainer state format {state.get('format')!r}")
        params = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        adapter = state["adapter"]
        if set(adapter) != set(params):
            missing = sorted(set(params) - set(adapter))[:3]
            extra = sorted(set(adapter) - set(params))[:3]
            raise ValueError(
                "checkpoint adapter does not match this model's LoRA config "
                f"(missing {missing}, unexpected {extra}); resume with the same lora settings"
            )
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(adapter[name].to(p.device, p.dtype))
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step_count = int(state["step"])
        if self.spike_clip is not None and "spike_clip" in state:
            self.spike_clip.load_state_dict(state["spike_clip"])
        rng = state["rng"]
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])

    def save_checkpoint(self, path: str | Path, *, extra: dict[str, Any] | None = None) -> Path:
        """Write ``trainer_state.pt`` (+ ``adapter/`` for humans and serving) into ``path``.

        ``extra`` is plain data the caller wants back on resume (e.g. its adapter version).
        The state file is written to a temporary name and renamed, so a crash mid-write leaves
        the previous checkpoint intact.
        """
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.save_adapter(path / ADAPTER_DIR)
        state = self.state_dict()
        state["extra"] = extra or {}
        tmp = path / f".{STATE_FILE}.tmp"
        torch.save(state, tmp)
        os.replace(tmp, path / STATE_FILE)
        return path

    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        """Restore from ``save_checkpoint``'s directory; returns its ``extra``."""
        state = torch.load(Path(path) / STATE_FILE, map_location="cpu", weights_only=True)
        self.load_state_dict(state)  # AdamW moves its state to the parameters' device
        return state.get("extra", {})


def _grad_norm(params: Sequence[torch.Tensor]) -> float:
    """The L2 norm of the parameters' gradients taken together (0 for none)."""
    return global_norm([p.grad for p in params if p.grad is not None])


def _copy_state(state: dict[str, Any]) -> dict[str, Any]:
    """A deep copy of a ``state_dict`` without its RNG (a snapshot training cannot mutate)."""
    return copy.deepcopy({k: v for k, v in state.items() if k != "rng"})


def _optimizer(
    params: list[torch.nn.Parameter], trainer: TrainerConfig
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over the adapter and its learning-rate schedule, as ``trainer`` sets them."""
    optimizer = torch.optim.AdamW(
        params,
        lr=trainer.learning_rate,
        weight_decay=trainer.weight_decay,
        betas=(trainer.adam_beta1, trainer.adam_beta2),
        eps=trainer.adam_epsilon,
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: lr_factor(
            step,
            schedule=trainer.lr_schedule,
            warmup_steps=trainer.warmup_steps,
            max_steps=trainer.max_steps,
        ),
    )
    return optimizer, schedule


def _token_logprobs(model: torch.nn.Module, row: PackedRow) -> torch.Tensor:
    return row_logprobs(model, row, with_entropy=False)[0]


@torch.no_grad()
def _swap(params: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Copy ``values`` into ``params`` in place; returns what they held."""
    held = [p.detach().clone() for p in params]
    for p, v in zip(params, values, strict=True):
        p.copy_(v)
    return held


def _padding_row(rows: Sequence[PackedRow]) -> PackedRow:
    """A micro-batch that only keeps FSDP's collectives in step (its loss is multiplied by 0)."""
    if rows:
        return rows[-1]
    pad = Sample(prompt_ids=[0], completion_ids=[0], logprobs=[0.0], reward=0.0, advantage=0.0,
                 version=0, group_id="padding")  # fmt: skip
    return build_row([pad], [0])
