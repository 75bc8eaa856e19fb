"""Weights & Biases through the real ``wandb`` client, offline: the run directory it writes is
read back with the client's own reader (``wandb leet inspect --json``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from asyncgrpo.config import TrainingConfig
from asyncgrpo.config.training import example_path
from asyncgrpo.errors import ConfigError
from asyncgrpo.run.metrics import MetricsWriter
from asyncgrpo.run.trackers import WandbTracker, check_wandb_key

pytest.importorskip("wandb")

WANDB = Path(sys.executable).with_name("wandb")


def _records(run_dir: Path) -> list[dict]:
    (log,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    out = subprocess.run(
        [str(WANDB), "leet", "inspect", "--json", str(log)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def test_wandb_offline_run_has_the_metrics_config_and_tags(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    cfg = TrainingConfig.from_yaml(
        example_path("examples/tiny_cpu.yaml"), [f"output_dir={tmp_path}", "logging.wandb=true"]
    )
    tracker = WandbTracker(
        run_dir=tmp_path,
        project="asyncgrpo-test",
        entity=None,
        run_name="tiny-1",
        tags=["ci", "tiny"],
        config={"trainer": {"learning_rate": 0.03}, "serve": {"api_key": None}},
    )
    with MetricsWriter(tmp_path, trackers=[tracker]) as w:
        w.log({"reward": 0.25, "ratio": float("nan")}, step=1)
        w.log({"reward": 0.75, "eval/version": 2.0, "eval/reward": 0.5}, step=2)
    records = _records(tmp_path)
    (run,) = [r["run"] for r in records if r["type"] == "run"]
    assert run["display_name"] == "tiny-1" and run["project"] == "asyncgrpo-test"
    assert run["tags"] == ["ci", "tiny"]
    assert run["config"]["update"]["trainer"] == {"learning_rate": 0.03}
    history = [r["history"] for r in records if r["type"] == "history"]
    assert [h["step"]["num"] for h in history] == [1, 2]
    assert history[0]["item"]["reward"] == 0.25 and "ratio" not in history[0]["item"]
    assert history[1]["item"]["eval/reward"] == 0.5
    metrics = [r["metric"] for r in records if r["type"] == "metric"]
    assert {"glob_name": "eval/*", "step_metric": "eval/version"} in [
        {k: m.get(k) for k in ("glob_name", "step_metric")} for m in metrics
    ]
    assert cfg.logging.wandb


def test_online_wandb_without_a_key_is_refused_before_anything_starts():
    with pytest.raises(ConfigError, match="WANDB_API_KEY"):
        check_wandb_key({"WANDB_MODE": "online"})
    with pytest.raises(ConfigError, match="WANDB_API_KEY"):
        check_wandb_key({})
    check_wandb_key({"WANDB_MODE": "offline"})
    check_wandb_key({"WANDB_API_KEY": "x" * 40})


def test_dry_run_reports_the_trackers_and_refuses_a_missing_key(tmp_path, monkeypatch):
    from asyncgrpo.run.preflight import dry_run

    cfg = TrainingConfig.from_yaml(
        example_path("examples/tiny_cpu.yaml"), [f"output_dir={tmp_path}", "logging.wandb=true"]
    )
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", "online")
    with pytest.raises(ConfigError, match="WANDB_API_KEY"):
        dry_run(cfg)
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert any(line.startswith("trackers: wandb") for line in dry_run(cfg))


def test_the_key_cannot_be_put_in_a_config(tmp_path):
    with pytest.raises(ConfigError, match="wandb_api_key"):
        TrainingConfig.from_yaml(
            example_path("examples/tiny_cpu.yaml"), ["logging.wandb_api_key=abc"]
        )


def test_wandb_is_not_loaded_by_a_run_without_it() -> None:
    code = (
        "import sys\n"
        "from asyncgrpo.run.metrics import MetricsWriter\n"
        "import asyncgrpo.run.training\n"
        "print('wandb' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr
