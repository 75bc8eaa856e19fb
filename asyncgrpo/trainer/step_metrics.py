"""What one optimizer step reports besides its loss: the samples it trained on, its batch, and
its time, throughput and memory (the device synchronised around every clock reading: CUDA runs
asynchronously)."""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Sequence

import torch

from asyncgrpo.sample import Sample, group_stats
from asyncgrpo.trainer.batch import StepBatch
from asyncgrpo.trainer.flops import ModelShape, step_flops

__all__ = ["StepTimer", "batch_metrics", "peak_memory_gib", "sample_metrics"]


class StepTimer:
    """The clock of one step: started at construction (the peak memory statistics reset),
    the forward and forward+backward seconds summed over its micro-steps."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.fwd_s = self.fwd_bwd_s = 0.0
        self.start = self.now()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    def now(self) -> float:
        """``perf_counter`` once the device has finished what was queued."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def micro_step(self, start: float, forward_end: float) -> None:
        """A micro-step that began at ``start`` and ended its forward at ``forward_end`` is
        over now."""
        self.fwd_s += forward_end - start
        self.fwd_bwd_s += self.now() - start


def batch_metrics(
    batch: StepBatch,
    timer: StepTimer,
    *,
    shape: ModelShape,
    peak_flops: float | None,
) -> dict[str, float]:
    """The step's batch, its time (from ``timer``'s start to now), throughput and memory, and
    MFU when ``peak_flops`` is known: this rank's rows over this rank's time, so per device."""
    fwd_bwd_s = timer.fwd_bwd_s
    metrics = {
        "batch/tokens": float(batch.total_tokens),
        "batch/completion_tokens": float(batch.num_tokens),
        "batch/microbatches_per_step": float(batch.num_rows),
        "batch/row_tokens_max": float(batch.row_tokens_max),
        "perf/fwd_s": timer.fwd_s,
        "perf/fwd_bwd_s": fwd_bwd_s,
        "perf/train_step_s": timer.now() - timer.start,
        "perf/tokens_per_s": batch.total_tokens / fwd_bwd_s if fwd_bwd_s > 0 else math.nan,
        "perf/peak_mem_gib": peak_memory_gib(timer.device),
    }
    if peak_flops is not None and fwd_bwd_s > 0:
        rows = batch.rows
        local = sum(row.num_completion_tokens for row in rows)
        flops = step_flops(shape, (n for row in rows for n in row.seq_lens), local)
        metrics["perf/mfu"] = flops / fwd_bwd_s / peak_flops
    return metrics


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
