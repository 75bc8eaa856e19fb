"""The trainer: one optimizer step at a time over scored samples, read top to bottom.

``Trainer.step(samples)`` does, in order: pack the samples into token-budget rows, run one
micro-step (forward, loss, backward) per row, clip the gradient, take the AdamW step, bound the
update, and return the step's metrics. Each stage is a module of its own that the step composes,
each taking only the settings it uses: the rows and counts (:mod:`~asyncgrpo.trainer.batch`),
the objective (:mod:`~asyncgrpo.trainer.objective`), the clip
(:mod:`~asyncgrpo.trainer.clipping`), AdamW and its schedule
(:mod:`~asyncgrpo.trainer.optimizer`), the update's bounds
(:mod:`~asyncgrpo.trainer.trust_region`), the collapse alarm's action
(:mod:`~asyncgrpo.trainer.collapse_guard`) and the state on disk
(:mod:`~asyncgrpo.trainer.checkpoint`). Everything around it (waiting for rollouts, dropping
stale samples, publishing adapter versions, checkpoint upload, logging) belongs to the caller
(``run_training``), so this class knows nothing about HTTP or storage.

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
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from asyncgrpo.errors import ConfigError
from asyncgrpo.sample import Sample, SampleBounds, scale_advantages
from asyncgrpo.trainer import checkpoint
from asyncgrpo.trainer.batch import pack_step
from asyncgrpo.trainer.checkpoint import ADAPTER_DIR, STATE_FILE
from asyncgrpo.trainer.clipping import GradientClip
from asyncgrpo.trainer.collapse_guard import CollapseGuard
from asyncgrpo.trainer.flops import ModelShape
from asyncgrpo.trainer.loss import Objective, add_stats, finalize_stats
from asyncgrpo.trainer.model import (
    context_length,
    default_device,
    load_adapter_weights,
    load_policy,
    row_logprobs,
)
from asyncgrpo.trainer.model import save_adapter as _save_adapter
from asyncgrpo.trainer.objective import StepObjective
from asyncgrpo.trainer.optimizer import lr_factor, make_optimizer, optimizer_step
from asyncgrpo.trainer.packing import pack_samples
from asyncgrpo.trainer.step_metrics import StepTimer, batch_metrics, sample_metrics
from asyncgrpo.trainer.trust_region import UpdateBound

if TYPE_CHECKING:
    from asyncgrpo.config.trainer import LoraConfig, TrainerConfig
    from asyncgrpo.config.training import TrainingConfig
    from asyncgrpo.trainer.distributed import DataParallel

__all__ = ["ADAPTER_DIR", "STATE_FILE", "Trainer", "lr_factor"]

logger = logging.getLogger(__name__)


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
        self.optimizer, self.scheduler = make_optimizer(self.params, trainer)
        self.step_count = 0  # optimizer steps taken
        self._published: tuple[int, int] | None = None  # (newest version, step it was saved at)
        # the stages of a step, each given the settings it uses under their config names
        self.objective = StepObjective(
            Objective.from_config(trainer),
            loss_type=trainer.loss_type,
            max_completion_length=max_completion_length,
            buckets=trainer.max_staleness + 1,
        )
        clip = _settings(
            trainer, "max_grad_norm", "spike_clip_z", "spike_clip_decay", "spike_clip_warmup"
        )
        self.clip = GradientClip(**clip)
        self.spike_clip = self.clip.spike  #: spike_clip_z's statistics (None: off)
        bound = _settings(
            trainer, "max_update_rms", "max_update_kl", "update_kl", "update_kl_history"
        )
        self.update_bound = UpdateBound(self.model, self.params, dp=dp, **bound)
        guard = _settings(
            trainer,
            "collapse_action",
            "collapse_window",
            "collapse_drop",
            "collapse_min_gain",
            "collapse_lr_factor",
            "max_staleness",
        )
        self.collapse = CollapseGuard(self.model, self.optimizer, self.scheduler, **guard)

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

    @property
    def max_completion_length(self) -> int | None:
        """The completion-length bound of loss_type=dr_grpo (None: each step's longest)."""
        return self.objective.max_completion_length

    @max_completion_length.setter
    def max_completion_length(self, value: int | None) -> None:
        self.objective.max_completion_length = value

    @property
    def stop_requested(self) -> bool:
        """trainer.collapse_action=stop fired: the caller ends the run after this step."""
        return self.collapse.stop_requested

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
        metrics.update(self.collapse(metrics, samples, self.step_count))
        return metrics

    def _step(
        self,
        samples: Sequence[Sample],
        step_samples: Sequence[Sample] | None,
        clock: tuple[int, bool],
    ) -> dict[str, float]:
        """Train on this rank's ``samples``; ``step_samples`` are all ranks' (rank 0 only);
        ``clock`` is rank 0's ``policy_clock``."""
        cfg, dp = self.config, self.dp
        timer = StepTimer(self.device)
        batch = pack_step(
            samples,
            token_budget=cfg.token_budget,
            gradient_accumulation_steps=cfg.gradient_accumulation_steps,
            fsdp=cfg.fsdp,
            dp=dp,
        )
        lr = self.scheduler.get_last_lr()[0]

        # micro-steps: forward, loss, backward; the gradients add up to the step's loss
        self.model.train()
        loss, sums = 0.0, {}
        for i in range(batch.micro_steps):
            row, weight = batch.row(i)  # weight 0: a pass that keeps FSDP's ranks in step
            start = timer.now()
            logp, entropy = row_logprobs(self.model, row)
            forward_end = timer.now()
            batch.logps.append(logp.detach())
            row_loss, part = self.objective.row_loss(self.model, row, logp, entropy, batch, clock)
            (row_loss * weight).backward()
            timer.micro_step(start, forward_end)
            if weight:
                loss += float(row_loss.detach())
                add_stats(sums, part)
        if dp is not None:  # the gradient of the whole step; the metric sums of all ranks
            dp.sum_gradients(self.params)
            loss, sums = self.objective.all_ranks(dp, loss, sums)

        # clip, the AdamW step and the schedule's (a non-finite gradient skips the update)
        grad_norm = self.clip(self.params)
        before = [p.detach().clone() for p in self.params]
        step_lr = self.optimizer.param_groups[0]["lr"]  # this step's: the schedule advances
        optimizer_step(self.optimizer, self.scheduler, grad_norm, self.step_count)

        # the update's bounds: its RMS per coordinate, its KL (the trust region)
        stepped = math.isfinite(grad_norm)
        update = self.update_bound(before, batch, lr=step_lr, stepped=stepped)
        self.step_count += 1

        metrics = {
            "loss": loss,
            "grad_norm": grad_norm,
            "learning_rate": lr,
            **finalize_stats(sums, self.objective.buckets),
            **update,
            **({} if self.spike_clip is None else {"collapse/spike_clip": self.clip.factor}),
            **batch_metrics(batch, timer, shape=self.shape, peak_flops=cfg.peak_flops),
        }
        if step_samples is not None:
            metrics.update(sample_metrics(step_samples))
            metrics["batch/samples"] = float(len(step_samples))
            metrics["batch/samples_per_row"] = len(step_samples) / batch.num_rows
        if dp is not None:
            metrics["batch/ranks"] = float(dp.world_size)
        return metrics

    def scaled(self, samples: Sequence[Sample]) -> list[Sample]:
        """``samples`` with advantages under ``trainer.scale_rewards`` (the rollout scaled them
        per group; 'batch' and 'none' rescale them here, from their rewards)."""
        scale = self.config.scale_rewards
        if scale == "group":
            return list(samples)
        advs = scale_advantages(
            [s.reward for s in samples],
            [s.advantage for s in samples],
            [s.group_id for s in samples],
            scale,
        )
        return [dataclasses.replace(s, advantage=a) for s, a in zip(samples, advs, strict=True)]

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
        self.dp.barrier("the end of training")
        return steps

    def release(self) -> None:
        """Rank 0, at the end of training: let the other ranks' ``follow`` return. It returns
        once every rank has taken the end: a process that exits while a peer is still inside a
        collective can abort that peer (gloo closes the connection under it)."""
        if self.dp is not None and self.dp.is_main:
            self.dp.scatter(None)
            self.dp.barrier("the end of training")

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
            self.collapse.published(version, self.step_count)  # samples may come from it
        return out

    # -- checkpointing ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue bit-for-bit: adapter, optimizer, schedule, step, RNG."""
        return checkpoint.state_dict(
            self.model,
            self.optimizer,
            self.scheduler,
            step=self.step_count,
            spike_clip=self.spike_clip,
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step_count = checkpoint.load_state_dict(
            state, self.model, self.optimizer, self.scheduler, spike_clip=self.spike_clip
        )

    def save_checkpoint(self, path: str | Path, *, extra: dict[str, Any] | None = None) -> Path:
        """Write ``trainer_state.pt`` (+ ``adapter/`` for humans and serving) into ``path``.

        ``extra`` is plain data the caller wants back on resume (e.g. its adapter version).
        """
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.save_adapter(path / ADAPTER_DIR)
        checkpoint.write_state(path, {**self.state_dict(), "extra": extra or {}})
        return path

    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        """Restore from ``save_checkpoint``'s directory; returns its ``extra``."""
        state = checkpoint.read_state(Path(path))
        self.load_state_dict(state)
        return state.get("extra", {})


def _settings(cfg: TrainerConfig, *names: str) -> dict[str, Any]:
    """``{name: cfg.<name>}``: the settings one stage of the step takes, by their config names
    (the reader of the call sees which ones it uses)."""
    return {name: getattr(cfg, name) for name in names}
