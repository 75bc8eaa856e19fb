"""Where the run resumes: a newest checkpoint that does not verify sends
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

    cfg = TrainingConfig.from_dict(
        {"model": str(tiny_model), "dataset": {"prompts": ["p"]}, "output_dir": str(tmp_path)}
    )
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


@pytest.mark.parametrize(
    ("step", "checkpoint", "said"),
    [
        (
            4,
            3,
            "interrupted at step 4: the checkpoint of step 3 is kept, and the same command "
            "resumes from it; steps 4-4 are trained again",
        ),
        # a checkpoint saved before its step's metrics line: that step is done (a resume writes
        # the line from the checkpoint), nothing is trained again
        (
            5,
            6,
            "interrupted at step 6: the checkpoint of step 6 is kept, and the same command "
            "resumes from it",
        ),
        (
            None,
            None,
            "interrupted, before the first checkpoint (trainer.save_steps=3): a rerun "
            "starts from step 0",
        ),
    ],
)
def test_an_interruption_reports_the_last_step_done_and_what_a_rerun_trains_again(
    step: int | None, checkpoint: int | None, said: str, tmp_path: Path
) -> None:
    """The step reported is the last one in metrics.jsonl (a step trained but not yet logged is
    not done: a rerun trains it), or the checkpoint's step if that is newer."""
    from asyncgrpo.run.training import _Progress

    data = {"model": "m", "dataset": {"prompts": ["p"]}, "trainer": {"save_steps": 3}}
    cfg = TrainingConfig.from_dict({**data, "output_dir": str(tmp_path)})
    assert _Progress(step=step, checkpoint=checkpoint).interrupted(cfg) == said
