"""``bench/rollout_encoding.py`` on a small batch: every codec it compares (the JSONL one lives
there) must round-trip exactly, so the measured alternative cannot rot."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_rollout_encoding_bench_runs_and_roundtrips():
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "rollout_encoding.py"),
            "--samples",
            "4",
            "--prompt",
            "8",
            "--completion",
            "16",
            "--rounds",
            "1",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    for name in ("agrb (binary)", "jsonl", "agrb + zlib-1", "jsonl + zlib-1"):
        assert name in out.stdout
