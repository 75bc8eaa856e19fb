"""A data-parallel rank other than 0 (``torchrun --nproc-per-node N -m asyncgrpo train``).

Rank 0 runs :func:`~asyncgrpo.run.training.run_training`: it alone talks to the replicas, writes the
transport and logs. Every other rank builds the same trainer, resumes from the checkpoint rank 0
names, and trains on the shards of each step rank 0 scatters until rank 0 releases it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import anyio

from asyncgrpo.config.training import run_transport_url
from asyncgrpo.store.checkpoints import CheckpointStore
from asyncgrpo.store.run_documents import RunResult
from asyncgrpo.transport import open_transport

if TYPE_CHECKING:
    from asyncgrpo.config.training import TrainingConfig


async def follow(cfg: TrainingConfig, dp: Any) -> RunResult:
    """Train as rank ``dp.rank`` until rank 0 releases the group.

    It reads the transport (the checkpoint) and never writes it; nothing here logs metrics.
    """
    from asyncgrpo.trainer.loop import Trainer

    try:
        trainer = await anyio.to_thread.run_sync(lambda: Trainer.from_config(cfg, dp=dp))
        start = await anyio.to_thread.run_sync(dp.broadcast, None)
        url = run_transport_url(cfg)
        if start["step"] is not None:
            async with open_transport(url) as transport:
                dest = cfg.run_dir / "resume" / f"rank-{dp.rank}"
                ckpt_dir, _ = await CheckpointStore(transport).load(start["step"], dest)
            await anyio.to_thread.run_sync(trainer.load_checkpoint, ckpt_dir)
        await anyio.to_thread.run_sync(trainer.follow)
    finally:
        dp.close()
    return RunResult(
        run_dir=cfg.run_dir,
        adapter_prefix=start["prefix"],
        steps=trainer.step_count,
        final_version=-1,
        resumed_from_step=start["step"],
        transport_url=url,
        rank=dp.rank,
    )
