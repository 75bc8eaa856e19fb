"""Issue 34, finding 10, where the run resumes: a newest checkpoint that does not verify sends
the trainer back to the one before it (one log line), not to an error at every restart."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from asyncgrpo.config.training import TrainingConfig
from asyncgrpo.run.progress import Silent
from asyncgrpo.run.training import _start_trainer
from asyncgrpo.store.checkpoints import CheckpointStore
from asyncgrpo.transport.local import LocalTransport

pytestmark = pytest.mark.anyio


async def test_the_trainer_resumes_from_the_newest_checkpoint_that_verifies(
    tiny_model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from asyncgrpo.trainer.loop import Trainer

    cfg = TrainingConfig.from_dict({"model": str(tiny_model), "dataset": {"prompts": ["p"]},
                                    "output_dir": str(tmp_path)})  # fmt: skip
    checkpoints = CheckpointStore(LocalTransport(tmp_path / "store"))
    trainer = Trainer.from_config(cfg, device="cpu")
    for step in (4, 8):
        state = trainer.save_checkpoint(tmp_path / f"ckpt-{step}", extra={"version": step})
        await checkpoints.save(step, state, {"position": step * 16})
    (victim,) = (tmp_path / "store").glob("checkpoints/step-000000008/files-*/**/*.safetensors")
    good = victim.read_bytes()
    victim.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))  # a damaged newest checkpoint
    run = SimpleNamespace(cfg=cfg, checkpoints=checkpoints, prefix="run")
    with caplog.at_level("WARNING", logger="asyncgrpo.store.checkpoints"):
        start = await _start_trainer(run, None, tmp_path / "work", Silent())  # type: ignore[arg-type]
    assert (start.resumed_from, start.position) == (4, 64)
    assert any("step 8 does not verify" in r.getMessage() for r in caplog.records)
