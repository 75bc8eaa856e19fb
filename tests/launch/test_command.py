"""``asyncgrpo launch`` as users run it: a separate process, ``HF_ENDPOINT`` at a local Hub."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from fake_jobs_hub import TOKEN, FakeHub

S3_KEY, S3_SECRET = "HFAKfakeaccesskey", "fakeS3secretvalue987"
LR = "trainer.learning_rate=1e-5,3e-5"


def write_config(tmp_path: Path) -> Path:
    path = tmp_path / "run.yaml"
    data = {
        "model": "Qwen/Qwen2.5-0.5B-Instruct",
        "run_name": "cli-run",
        "output_dir": str(tmp_path / "runs"),
        "transport_url": "hf://buckets/testns/asyncgrpo-runs/cli-run",
        "dataset": {"prompts": ["count to five"]},
        "trainer": {"max_staleness": 1},
    }
    path.write_text(yaml.safe_dump(data))
    return path


def env(hub: FakeHub, tmp_path: Path) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
        "HF_ENDPOINT": hub.url,
        "HF_HOME": str(tmp_path / "hf-home"),
        "HF_TOKEN": TOKEN,
        "HF_S3_ACCESS_KEY_ID": S3_KEY,
        "HF_S3_SECRET_ACCESS_KEY": S3_SECRET,
    }


def launch_cmd(config: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "asyncgrpo.cli.main", "launch", str(config), "--backend", "hf-jobs",
            *args]  # fmt: skip


def test_dry_run_prints_every_spec_and_sends_no_request(tmp_path: Path, hub: FakeHub) -> None:
    cmd = launch_cmd(
        write_config(tmp_path),
        "--dry-run",
        "--replicas",
        "3",
        "--replica-flavor",
        "l4x1",
        "launch.timeout=2h",
    )
    out = subprocess.run(cmd, env=env(hub, tmp_path), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert [
        line.split()[0]
        for line in text.splitlines()
        if line.endswith(("-0", "-1", "-2", "trainer")) and " job " in line
    ] == ["replica", "replica", "replica", "trainer"]
    assert text.count("flavor:  l4x1") == 3 and text.count("flavor:  a100-large") == 1
    # the trainer's proxy listens behind the gateway too: the launcher adds replacements to it
    assert text.count("timeout: 7200 s") == 4 and text.count("ports:   8000") == 4
    assert "proxy.host=0.0.0.0 proxy.port=8000" in text
    assert "secrets: HF_S3_ACCESS_KEY_ID, HF_S3_SECRET_ACCESS_KEY, HF_TOKEN" in text
    for value in (TOKEN, S3_KEY, S3_SECRET):
        assert value not in text + out.stderr
    assert hub.requests == []


@pytest.mark.parametrize(
    ("change", "refusal"),
    [
        ({"transport_url": None}, "transport_url is unset: jobs share no disk"),
        ({"model": "LOCAL"}, "is a local path, which the jobs cannot read"),
    ],
    ids=["no-transport", "local-model"],
)
def test_a_dry_run_refuses_what_the_launch_would(
    tmp_path: Path, hub: FakeHub, change: dict, refusal: str
) -> None:
    """It prints the specs, then refuses in one line, status 2, what a real launch refuses
    before its first request; it sends none either."""
    config = write_config(tmp_path)
    data = yaml.safe_load(config.read_text())
    if change.get("model") == "LOCAL":
        (tmp_path / "my-model").mkdir()
        change = {"model": str(tmp_path / "my-model")}
    data.update(change)
    data = {k: v for k, v in data.items() if v is not None}
    config.write_text(yaml.safe_dump(data))
    out = subprocess.run(
        launch_cmd(config, "--dry-run"),
        env=env(hub, tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and refusal in lines[0], out.stderr
    assert "trainer job cli-run-trainer" in out.stdout  # the specs came first
    assert hub.requests == []


def test_a_sweep_dry_run_shows_one_fleet_and_one_trainer_per_point(
    tmp_path: Path, hub: FakeHub
) -> None:
    cmd = launch_cmd(
        write_config(tmp_path),
        "--dry-run",
        "--replicas",
        "2",
        "--sweep",
        LR,
        "--sweep",
        "lora.r=4,8",
    )
    out = subprocess.run(cmd, env=env(hub, tmp_path), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    heads = [line.split()[:3] for line in text.splitlines() if " job " in line]
    assert heads == [
        ["replica", "job", "cli-run-replica-0"],
        ["replica", "job", "cli-run-replica-1"],
        ["proxy", "job", "cli-run-proxy"],
        *(["trainer", "job", f"cli-run-{i}-trainer"] for i in range(4)),
    ]
    assert "point cli-run-3: trainer.learning_rate=3e-5 lora.r=8" in text
    # the fleet holds every point's window (4 x (max_staleness 1 + 2)) at the largest rank
    assert text.count("--lora-rank 8 --max-staleness 1") == 2 and text.count("--max-loras 12") == 2
    assert "-m asyncgrpo.proxy --host 0.0.0.0 --port 8000 --upstream '<replica-0 URL>'" in text
    assert text.count("'proxy.upstreams=<proxy URL>'") == 4
    for value in (TOKEN, S3_KEY, S3_SECRET):
        assert value not in text + out.stderr
    assert hub.requests == []


@pytest.mark.parametrize(("sweep", "trainers", "jobs"), [((), 1, 3), (("--sweep", LR), 2, 5)])
def test_sigterm_cancels_every_started_job(
    tmp_path: Path, hub: FakeHub, sweep: tuple[str, ...], trainers: int, jobs: int
) -> None:
    """Two replicas and a trainer; a sweep's: two replicas, its proxy and a trainer per point."""
    hub.scripts["trainer"] = lambda: {"logs": ["training"]}  # never completes
    cmd = launch_cmd(write_config(tmp_path), "--replicas", "2", "launch.poll_s=0.1", *sweep)
    proc = subprocess.Popen(
        cmd, env=env(hub, tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 60
        while len(hub.created("trainer")) < trainers:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the trainer job was never created"
            time.sleep(0.1)
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr
    assert len(hub.jobs) == jobs
    assert hub.cancelled() == set(hub.jobs)
    assert "cancelled" in stderr
    logs = "".join(p.read_text() for p in (tmp_path / "runs" / "cli-run-launch").iterdir())
    for value in (TOKEN, S3_KEY, S3_SECRET):
        assert value not in stdout + stderr + logs


def test_a_completed_launch_ends_with_trains_summary(tmp_path: Path, hub: FakeHub) -> None:
    """The trainer job's progress lines and its last line (``asyncgrpo-result {...}``) give the
    launcher the summary ``asyncgrpo train`` prints; its paths are on the job's machine."""
    from asyncgrpo.run.progress import progress_line, result_line
    from asyncgrpo.store.run_documents import RunResult

    result = RunResult(
        run_dir=Path("/job/runs/cli-run"),
        adapter_prefix="cli-run-ab12",
        steps=3,
        final_version=3,
        resumed_from_step=None,
        transport_url="hf://buckets/testns/asyncgrpo-runs/cli-run",
        adapter_dir=Path("/job/runs/cli-run/adapter"),
    )
    evals = [
        {"eval/version": 0, "eval/reward": 0.1, "eval/pass@1": 0.1, "eval/prompts": 4},
        {"eval/version": 3, "eval/reward": 0.4, "eval/pass@1": 0.3, "eval/prompts": 4},
    ]
    lines = [progress_line(s, 3, {"reward": s / 10}) for s in (1, 2, 3)]
    hub.scripts["replica"] = lambda: {"healthy_after_s": 0.1}
    hub.scripts["trainer"] = lambda: {
        "logs": [*lines, "trained 3 steps", result_line(result, evals)],
        "complete_after_s": 0.3,
    }
    cmd = launch_cmd(write_config(tmp_path), "--replicas", "1", "launch.poll_s=0.1")
    done = subprocess.run(cmd, env=env(hub, tmp_path), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = done.stdout[done.stdout.index("trained 3 steps in ") :].splitlines()
    where = " (on the trainer job's machine)"
    assert summary[1:] == [
        "reward 0.200 -> 0.200 (mean of the first and last 3 steps of this run)",
        "held-out reward: 0.100 (version 0) -> 0.400 (version 3) over 4 prompts the trainer never "
        "saw; pass@1 0.10 -> 0.30",
        "final adapter: cli-run-ab12-v3 in hf://buckets/testns/asyncgrpo-runs/cli-run",
        f"PEFT directory: /job/runs/cli-run/adapter{where}",
        f"metrics: /job/runs/cli-run/metrics.jsonl{where}",
    ], summary
