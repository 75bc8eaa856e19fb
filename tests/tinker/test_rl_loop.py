"""The RL loop in tinker-cookbook's shape (``examples/tinker_rl_loop.py``) learns the digits
task through the SDK on real vLLM replicas, as the native loop does."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tinker_rl_loop.py"


def test_reward_rises_past_a_half_within_forty_steps(fleet: str, tiny_model: Path) -> None:
    run = subprocess.run([sys.executable, str(EXAMPLE), "--base-url", fleet, "--model",
                          str(tiny_model), "--steps", "40", "--seed", "0"],
                         capture_output=True, text=True, timeout=900)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    rewards = json.loads(run.stdout.strip().splitlines()[-1])["rewards"]
    assert len(rewards) == 40
    assert max(rewards) > 0.5, rewards
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.2, rewards
