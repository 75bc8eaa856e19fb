"""``bench/eval.py --curve --report`` on run directories written here: the held-out reward of
version v sits beside the training reward of step v+1 (the step that trained on version v's
samples), means and spreads are over the seeds, and the plot is drawn."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from asyncgrpo.evaluation.records import EVAL_METRICS_FILE
from asyncgrpo.run.metrics import MetricsWriter

ROOT = Path(__file__).resolve().parents[2]


def write_run(run_dir: Path, held: dict[int, float], offset: float) -> None:
    """Ten steps whose training reward is step / 100 + offset; evaluations of ``held``."""
    with MetricsWriter(run_dir) as w:
        for step in range(1, 11):
            w.log({"reward": step / 100 + offset, "perf/step_s": 0.5}, step=step)
    with (run_dir / EVAL_METRICS_FILE).open("w") as f:
        for version, reward in held.items():
            f.write(
                json.dumps({"step": version, "eval/version": version, "eval/reward": reward}) + "\n"
            )


def test_the_curve_report_pairs_version_v_with_step_v_plus_1(tmp_path):
    runs = tmp_path / "curve" / "runs"
    write_run(runs / "k0-s0", {0: 0.0, 5: 0.2, 10: 0.9}, offset=0.0)
    write_run(runs / "k0-s1", {0: 0.1, 5: 0.4, 10: 1.0}, offset=0.1)
    write_run(runs / "k4-s0", {0: 0.0, 5: 0.1, 10: 0.8}, offset=0.0)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "eval.py"),
            "--curve",
            "--report",
            "--seeds",
            "0,1",
            "--staleness",
            "0,4",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {
        line.split("|")[1].strip(): line
        for line in out.stdout.splitlines()
        if line.startswith("| 5 |") or line.startswith("| 10 |")
    }
    # version 5: held-out 0.2 and 0.4 at staleness 0; training reward of step 6: 0.06 and 0.16
    assert (
        "| 5 | 0.300 [0.200, 0.400] (2) | 0.110 | 0.100 [0.100, 0.100] (1) | 0.060 |" in rows["5"]
    )
    assert rows["10"].endswith("| 0.950 [0.900, 1.000] (2) | - | 0.800 [0.800, 0.800] (1) | - |")
    # seed 1 at 0: held-out - training over versions 0 and 5 = ((0.1-0.11) + (0.4-0.16)) / 2
    assert "| 0 | 1 | 0.100 -> 1.000 | 1 | +0.115 |" in out.stdout
    assert (tmp_path / "curve" / "curve.png").read_bytes()[:4] == b"\x89PNG"
