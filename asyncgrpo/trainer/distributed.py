"""Data parallelism over torch.distributed: this rank, its share of a step, and the collectives.

Started by ``torchrun --nproc-per-node N -m asyncgrpo train CONFIG``, which sets ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK`` and the rendezvous address. Rank 0 is the only rank that talks
to the outside (rollouts, replicas, the transport, logs): it gathers each step's samples and
scatters them, split by tokens, to all ranks (``scatter_object_list``); the other ranks only
compute. Every rank holds the whole adapter, so rank 0 alone can save, publish and checkpoint
it.

Why summing gradients is exact: each rank's loss is ``sum(loss_t over its tokens) / N`` with
``N`` the completion tokens of *all* ranks (``all_reduce`` of the counts before the first
micro-batch), so the step's gradient is the sum of the ranks' gradients. One ``all_reduce``
(SUM) of the adapter's flattened gradients after the micro-steps gives every rank that sum: the
gradient DDP would give (DDP averages, which with a loss scaled by the world size is the same),
without hooking every backward. Clipping and AdamW then run identically everywhere, so the
adapters stay equal without further communication.

``fsdp``: FSDP2 (``fully_shard``) shards the frozen base weights over the ranks, one unit per
decoder layer, and all-gathers a layer's weights for its forward and backward. The LoRA
parameters are left out of it (``ignored_params``) and stay whole: the adapter is tiny, and the
rest of the trainer (gradient all-reduce, save, checkpoint) stays the same. Every rank must then
run the same number of forward/backward passes, hence ``pad_rows``.

A rank that dies or hangs: gloo notices a closed connection at once, NCCL after ``timeout_s``;
either way the collective raises, and :class:`~asyncgrpo.errors.RankError` names the rank and
what to do; torchrun's agent then stops the other ranks and exits non-zero, naming the rank.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from asyncgrpo.errors import ConfigError, RankError
from asyncgrpo.sample import Sample
from asyncgrpo.trainer.packing import plan_rows

logger = logging.getLogger(__name__)

T = TypeVar("T")


def shard_samples(samples: Sequence[Sample], world_size: int) -> list[list[Sample]]:
    """Split a step's samples into ``world_size`` shards of about equal token count.

    Longest first onto the shard with the fewest tokens so far (``plan_rows``'s balancing);
    a shard is empty only when there are fewer samples than ranks.
    """
    plan = plan_rows([s.num_tokens for s in samples], num_rows=world_size) if samples else []
    shards = [[samples[i] for i in indices] for indices in plan]
    return shards + [[] for _ in range(world_size - len(shards))]


@dataclass
class DataParallel:
    """This process's place in the data-parallel group (``world_size > 1``)."""

    rank: int
    world_size: int
    local_rank: int = 0
    timeout_s: float = 1800.0
    #: the setting a RankError names for the timeout, and what it says happens next
    timeout_setting: str = "trainer.dp_timeout_s"
    aftermath: str = "The job stops; start it again and it resumes from the latest checkpoint"

    @classmethod
    def from_env(cls, *, timeout_s: float = 1800.0, **wording: str) -> DataParallel | None:
        """Join the group torchrun describes in the environment; None for a single process.
        ``wording``: ``timeout_setting`` and ``aftermath`` for its RankErrors."""
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if world_size <= 1:
            return None
        rank = int(os.environ["RANK"])
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        dp = cls(
            rank=rank, world_size=world_size, local_rank=local_rank, timeout_s=timeout_s, **wording
        )
        if not dist.is_initialized():
            backend = "gloo"
            if torch.cuda.is_available():
                torch.cuda.set_device(local_rank)
                backend = "cpu:gloo,cuda:nccl"  # objects travel on CPU, tensors on the GPU
            dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
        logger.info("data-parallel rank %d of %d (local rank %d)", rank, world_size, local_rank)
        return dp

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def device(self) -> torch.device:
        """This rank's device: its own GPU (``LOCAL_RANK``) or the CPU."""
        if torch.cuda.is_available():
            return torch.device("cuda", self.local_rank)
        return torch.device("cpu")

    def _collective(self, what: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except (RuntimeError, dist.DistError) as exc:
            raise RankError(
                f"rank {self.rank} of {self.world_size}: {what} failed, so another rank died or "
                f"did not answer within {self.timeout_setting}={self.timeout_s:g} ({exc}). "
                f"{self.aftermath}"
            ) from exc

    # -- samples ------------------------------------------------------------------------------
    def scatter(
        self, samples: Sequence[Sample] | None, context: Any = None
    ) -> tuple[list[Sample], Any] | None:
        """Rank 0 passes the step's samples (or None: training is over) and ``context``, plain
        data every rank needs (e.g. the trainer's policy version); every rank gets its
        token-balanced shard and the context (or None)."""
        shards: list[Any] | None = None
        if self.is_main:
            shards = (
                [None] * self.world_size
                if samples is None
                else [(shard, context) for shard in shard_samples(samples, self.world_size)]
            )
        out: list[Any] = [None]
        self._collective(
            "receiving this step's samples",
            lambda: dist.scatter_object_list(out, shards, src=0),
        )
        return out[0]

    def broadcast(self, obj: T | None) -> T:
        """Rank 0's ``obj`` on every rank (e.g. the checkpoint step all ranks resume from)."""
        box = [obj]
        self._collective("broadcast from rank 0", lambda: dist.broadcast_object_list(box, src=0))
        return box[0]  # type: ignore[return-value]

    def scatter_objects(self, objs: Sequence[Any] | None) -> Any:
        """Rank 0 passes one picklable object per rank (others pass None); each rank gets its
        own (the Tinker service's operations, each rank's share of a request)."""
        out: list[Any] = [None]
        sent = list(objs) if self.is_main and objs is not None else None
        self._collective(
            "passing on rank 0's next operation", lambda: dist.scatter_object_list(out, sent, src=0)
        )
        return out[0]

    def gather_objects(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` on rank 0, in rank order (None on the other ranks)."""
        box: list[Any] | None = [None] * self.world_size if self.is_main else None
        self._collective("gathering results on rank 0", lambda: dist.gather_object(obj, box, dst=0))
        return box

    # -- tensors ------------------------------------------------------------------------------
    def gather_counts(self, values: Sequence[float]) -> torch.Tensor:
        """Every rank's ``values`` as a ``[world_size, len(values)]`` float64 tensor."""
        local = torch.tensor(list(values), dtype=torch.float64, device="cpu")
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        self._collective("exchanging token counts", lambda: dist.all_gather(parts, local))
        return torch.stack(parts).cpu()

    def sum(self, values: Sequence[float]) -> list[float]:
        """Element-wise sum of ``values`` over the ranks (metric sums)."""
        t = torch.tensor(list(values), dtype=torch.float64, device="cpu")
        self._collective("summing metrics", lambda: dist.all_reduce(t))
        return t.cpu().tolist()

    def max(self, values: Sequence[float]) -> list[float]:
        """Element-wise maximum of ``values`` over the ranks (metric maxima)."""
        t = torch.tensor(list(values), dtype=torch.float64, device="cpu")
        self._collective("reducing metrics", lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX))
        return t.cpu().tolist()

    def sum_gradients(self, params: Sequence[torch.Tensor]) -> None:
        """Replace each parameter's gradient by the sum over the ranks (None counts as zero)."""
        if not params:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        self._collective("summing adapter gradients", lambda: dist.all_reduce(flat))
        offset = 0
        for p, g in zip(params, grads, strict=True):
            n = g.numel()
            p.grad = flat[offset : offset + n].view_as(p).clone()
            offset += n

    def broadcast_parameters(self, params: Sequence[torch.Tensor]) -> None:
        """Give every rank rank 0's values (as DDP does at start): equal adapters from step 0."""
        for p in params:
            self._collective("broadcasting the adapter", lambda p=p: dist.broadcast(p.data, src=0))

    def barrier(self, what: str) -> None:
        """Every rank has reached this point."""
        self._collective(what, dist.barrier)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def shard_base_model(model: torch.nn.Module, trainable: Sequence[torch.nn.Parameter]) -> None:
    """FSDP2 over the frozen base weights: one unit per decoder layer, plus the rest at the root.

    The adapter (``trainable``) is ignored by FSDP and stays a whole, ordinary tensor on every
    rank; its gradients are summed by :meth:`DataParallel.sum_gradients`.
    """
    from torch.distributed.fsdp import fully_shard

    ignored = set(trainable)
    layers = _decoder_layers(model)
    if not layers:
        raise ConfigError(
            "trainer.fsdp: no decoder layers found (a ModuleList named 'layers' or 'h'); "
            "set trainer.fsdp=false for this model"
        )
    for layer in layers:
        fully_shard(layer, ignored_params=ignored)
    fully_shard(model, ignored_params=ignored)


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and name.rsplit(".", 1)[-1] in ("layers", "h"):
            return list(module)
    return []
