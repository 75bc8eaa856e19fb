"""``bench/gpu_check.py`` in its reduced CPU mode, so the GPU readiness check cannot rot."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_reduced_runs_and_reports():
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "gpu_check.py"),
            "--reduced",
            "--steps",
            "1",
            "--peak-flops",
            "1e11",
            "--vllm",
            "off",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert "mode: reduced" in text
    # the table row: step, fwd+bwd, tokens/s, MFU (a percentage: --peak-flops was given), memory
    row = re.search(r"^\s*([\d.]+)\s+([\d.]+)\s+(\d+)\s+([\d.]+)%\s+([\d.]+)$", text, re.M)
    assert row, text
    step_s, fwd_bwd_s, tok_s, mfu, mem = (float(g) for g in row.groups())
    assert 0 < fwd_bwd_s <= step_s and tok_s > 0 and 0 < mfu < 100 and mem > 0
    assert "On a GPU this measures: the Qwen2.5-1.5B shape" in text
    assert "[0.9993, 1.0004]" in text
