"""The README's local sweep, typed as the README types it, in a fresh directory: the tiny model
built there with the README's command, then one replica and two steps per point."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncgrpo.run.progress import parse_progress

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.vllm
def test_the_readmes_sweep_runs_as_typed(tmp_path: Path) -> None:
    """Each point's trainer job runs in a directory of its own; the relative model path it was
    given (``runs/tiny-model``, from the example config) must still name the directory built
    here, not one in the job's directory (every trainer job used to exit 2 naming it)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    build = [sys.executable, "-m", "asyncgrpo.testing.tiny", "runs/tiny-model"]
    subprocess.run(build, cwd=tmp_path, env=env, check=True, capture_output=True, timeout=300)
    sweep = [sys.executable, "-m", "asyncgrpo", "launch", "examples/tiny_cpu.yaml",
             "--backend", "local", "--sweep", "trainer.learning_rate=1e-3,3e-3",
             "launch.replicas=1", "trainer.max_steps=2"]  # fmt: skip
    p = subprocess.run(sweep, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1500)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "every trainer completed" in p.stdout, p.stdout[-3000:]
    launch_dir = tmp_path / "runs" / "tiny-cpu" / "launch"
    for i in (0, 1):
        log = (launch_dir / f"tiny-cpu-{i}-trainer.log").read_text()
        steps = [r["step"] for r in map(parse_progress, log.splitlines()) if r is not None]
        assert steps == [1, 2], log[-3000:]
