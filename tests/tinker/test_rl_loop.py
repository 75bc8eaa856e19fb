"""The RL loop in tinker-cookbook's shape (``examples/tinker_rl_loop.py``) learns the digits
task through the SDK on real vLLM replicas, as the native loop does: two seeds at once, two
clients training two adapters through one fleet, each reaching its own reward."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm  # real vLLM replicas

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tinker_rl_loop.py"
STEPS = 40


def test_reward_rises_past_a_half_within_forty_steps_on_two_seeds_at_once(
    fleet: str, tiny_model: Path
) -> None:
    runs = {
        seed: subprocess.Popen(
            [
                sys.executable,
                str(EXAMPLE),
                "--base-url",
                fleet,
                "--model",
                str(tiny_model),
                "--steps",
                str(STEPS),
                "--seed",
                str(seed),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in (0, 1)
    }
    for seed, proc in runs.items():
        out, err = proc.communicate(timeout=900)
        assert proc.returncode == 0, err[-3000:]
        rewards = json.loads(out.strip().splitlines()[-1])["rewards"]
        first = next((i for i, r in enumerate(rewards) if r > 0.5), None)
        print(
            f"seed {seed}: first step above 0.5: {first}; rewards "
            f"{' '.join(f'{r:.2f}' for r in rewards)}"
        )
        assert len(rewards) == STEPS
        assert first is not None, rewards
        assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.2, rewards
